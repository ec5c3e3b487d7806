package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"

	"github.com/llmq/llmq/engine"
)

// apiError is an error with its HTTP status, answered in OpenAI's shape:
// {"error": {"message": …, "type": …, "param": …, "code": …}}, param and
// code null when they do not apply.
type apiError struct {
	Status  int
	Message string
	Type    string
	Param   string
	Code    string
	// RetryAfter, when positive, is sent as the Retry-After header (whole
	// seconds).
	RetryAfter int
}

func (e *apiError) Error() string { return e.Message }

func (e *apiError) MarshalJSON() ([]byte, error) {
	orNull := func(s string) *string {
		if s == "" {
			return nil
		}
		return &s
	}
	return json.Marshal(struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	}{e.Message, e.Type, orNull(e.Param), orNull(e.Code)})
}

func invalid(param, format string, args ...any) *apiError {
	return &apiError{Status: http.StatusBadRequest, Message: fmt.Sprintf(format, args...), Type: "invalid_request_error", Param: param}
}

// statusClientClosed is nginx's 499 "client closed request": the status
// logged for a request whose client went away before its answer.
const statusClientClosed = 499

// asAPIError maps any error to the answer a client gets.
func asAPIError(err error) *apiError {
	var ae *apiError
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.Is(err, engine.ErrInvalid):
		return invalid("", "%s", err.Error())
	case errors.Is(err, engine.ErrBusy):
		return &apiError{Status: http.StatusServiceUnavailable, Message: "the server is busy: too many requests waiting; retry later",
			Type: "server_error", Code: "overloaded", RetryAfter: 1}
	case errors.Is(err, engine.ErrClosed):
		return &apiError{Status: http.StatusServiceUnavailable, Message: "the server is shutting down", Type: "server_error", Code: "shutting_down"}
	case errors.Is(err, context.Canceled):
		// The client hung up (a deadline is context.DeadlineExceeded):
		// no one reads this answer, but its status goes into the log and
		// /metrics, where a 500 would let any client raise the server's
		// error rate.
		return &apiError{Status: statusClientClosed, Message: "the client closed the connection before the answer", Type: "invalid_request_error", Code: "client_closed_request"}
	}
	return &apiError{Status: http.StatusInternalServerError, Message: err.Error(), Type: "server_error"}
}

// writeError answers err in OpenAI's error shape and notes it for the log.
func writeError(w http.ResponseWriter, rs *reqState, err error) {
	ae := asAPIError(err)
	if ae.RetryAfter > 0 {
		w.Header().Set("Retry-After", fmt.Sprint(ae.RetryAfter))
	}
	if rs != nil {
		rs.err = ae.Message
	}
	writeJSON(w, ae.Status, map[string]any{"error": ae})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// jsonError explains a decoding error in the request's terms (JSON
// field names and JSON types), never Go's: encoding/json's own messages
// name Go structs and types ("Go struct field chatRequest.messages of
// type server.content").
func jsonError(err error) *apiError {
	var syn *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.As(err, &syn):
		return invalid("", "malformed JSON body at byte %d: %s", syn.Offset, strings.TrimPrefix(syn.Error(), "json: "))
	case errors.As(err, &typ):
		// The path names embedded structs by their Go names: keep the
		// JSON names alone.
		typ.Field = strings.TrimPrefix(typ.Field, "params.")
		if typ.Field == "" {
			return invalid("", "malformed JSON body: the body must be a JSON object, got %s", jsonKind(typ.Value))
		}
		return invalid(typ.Field, "malformed JSON body: %q must be %s, got %s", typ.Field, jsonTypeName(typ.Type.Kind().String()), jsonKind(typ.Value))
	case errors.Is(err, io.EOF):
		return invalid("", "malformed JSON body: the body is empty")
	case errors.Is(err, io.ErrUnexpectedEOF):
		return invalid("", "malformed JSON body: it ends before the JSON value does")
	}
	var fe *fieldError
	if errors.As(err, &fe) {
		return invalid(fe.field, "%s", fe.msg)
	}
	return invalid("", "malformed JSON body")
}

// jsonKind names the JSON value encoding/json found (it reports "bool",
// "number", "number 1.5", "string", "array", "object").
func jsonKind(v string) string {
	kind, _, _ := strings.Cut(v, " ")
	switch kind {
	case "bool":
		return "a boolean"
	case "array", "object":
		return "an " + kind
	}
	return "a " + kind
}

// jsonTypeName names the JSON type a Go kind is read from.
func jsonTypeName(kind string) string {
	switch kind {
	case "string":
		return "a string"
	case "bool":
		return "a boolean"
	case "int", "int8", "int16", "int32", "int64":
		return "an integer"
	case "uint", "uint8", "uint16", "uint32", "uint64":
		return "a non-negative integer"
	case "float32", "float64":
		return "a number"
	case "slice", "array":
		return "an array"
	case "struct", "map":
		return "an object"
	}
	return "another type"
}

// fieldError is a request field's own validation error, raised while
// decoding (a message content that is neither a string nor text parts).
type fieldError struct{ field, msg string }

func (e *fieldError) Error() string { return e.msg }
