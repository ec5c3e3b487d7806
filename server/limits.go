package server

import (
	"crypto/sha256"
	"crypto/subtle"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"time"
)

// authorized reports whether r carries the server's API key as
// "Authorization: Bearer KEY". Both sides are hashed first so that the
// constant-time comparison does not reveal the key's length either.
func (s *Server) authorized(r *http.Request) bool {
	if s.opt.APIKey == "" {
		return true
	}
	h := r.Header.Get("Authorization")
	const scheme = "bearer "
	if len(h) <= len(scheme) || !strings.EqualFold(h[:len(scheme)], scheme) {
		return false
	}
	got := sha256.Sum256([]byte(strings.TrimSpace(h[len(scheme):])))
	return subtle.ConstantTimeCompare(got[:], s.keyHash[:]) == 1
}

func unauthorized(r *http.Request) *apiError {
	msg := "missing API key: send it as \"Authorization: Bearer KEY\""
	if r.Header.Get("Authorization") != "" {
		msg = "incorrect API key (sent as \"Authorization: Bearer KEY\")"
	}
	return &apiError{Status: http.StatusUnauthorized, Message: msg, Type: "invalid_request_error", Code: "invalid_api_key"}
}

// tokenBucket admits rate requests a second on average, in bursts of up to
// burst.
type tokenBucket struct {
	mu     sync.Mutex
	rate   float64
	burst  float64
	tokens float64
	last   time.Time
}

func newTokenBucket(rate float64, burst int) *tokenBucket {
	b := float64(max(burst, 1))
	return &tokenBucket{rate: rate, burst: b, tokens: b}
}

// take spends one token if there is one; otherwise it returns how long
// until there will be.
func (b *tokenBucket) take(now time.Time) (bool, time.Duration) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if !b.last.IsZero() {
		b.tokens = math.Min(b.burst, b.tokens+now.Sub(b.last).Seconds()*b.rate)
	}
	b.last = now
	if b.tokens >= 1 {
		b.tokens--
		return true, 0
	}
	return false, time.Duration((1 - b.tokens) / b.rate * float64(time.Second))
}

// admit applies the rate limit to a generation request, and refuses at
// once, its body unread, one that finds every concurrency slot taken. It
// takes no slot: acquire does, once the body is read, so that a client
// that trickles its body (for up to the read timeout) holds none.
func (s *Server) admit() *apiError {
	if s.bucket != nil {
		if ok, wait := s.bucket.take(time.Now()); !ok {
			secs := int(math.Ceil(wait.Seconds()))
			return &apiError{Status: http.StatusTooManyRequests, Type: "requests", Code: "rate_limit_exceeded", RetryAfter: max(secs, 1),
				Message: fmt.Sprintf("rate limit reached: this server takes %g requests a second; retry in %d s", s.opt.RateLimit, max(secs, 1))}
		}
	}
	if s.slots != nil && len(s.slots) == cap(s.slots) {
		return s.tooMany()
	}
	return nil
}

// acquire takes a concurrency slot for a request whose body is read. On
// success the caller runs the request and then calls release.
func (s *Server) acquire() (release func(), err *apiError) {
	if s.slots == nil {
		return func() {}, nil
	}
	select {
	case s.slots <- struct{}{}:
		return func() { <-s.slots }, nil
	default:
		return nil, s.tooMany()
	}
}

func (s *Server) tooMany() *apiError {
	return &apiError{Status: http.StatusTooManyRequests, Type: "requests", Code: "rate_limit_exceeded", RetryAfter: 1,
		Message: fmt.Sprintf("too many concurrent requests: this server handles %d at once; retry later", s.opt.MaxConcurrent)}
}
