package tokenizer

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
	"golang.org/x/text/unicode/norm"
)

// gpt2Pattern is the pre-tokenizer regex of GPT-2, used by the ByteLevel
// pre-tokenizer when use_regex is true. `\s+(?!\S)` needs lookahead.
const gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`

// byteToRune is GPT-2's table mapping each byte to a printable character:
// printable Latin-1 bytes map to themselves, the rest to U+0100 onwards.
var byteToRune, runeToByte = func() ([256]rune, map[rune]byte) {
	var b2r [256]rune
	r2b := map[rune]byte{}
	n := 0
	for b := 0; b < 256; b++ {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			b2r[b] = rune(b)
		} else {
			b2r[b] = rune(256 + n)
			n++
		}
		r2b[b2r[b]] = byte(b)
	}
	return b2r, r2b
}()

type typed struct {
	Type string `json:"type"`
}

func typeOf(raw json.RawMessage) (string, bool, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", false, nil
	}
	var t typed
	if err := json.Unmarshal(raw, &t); err != nil {
		return "", false, err
	}
	return t.Type, true, nil
}

// pattern is tokenizer.json's {"String": ...} or {"Regex": ...}.
type pattern struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

func (p pattern) compile() (*regexp2.Regexp, error) {
	switch {
	case p.Regex != nil:
		re, err := regexp2.Compile(*p.Regex, regexp2.Unicode)
		if err != nil {
			return nil, fmt.Errorf("regex %q: %w", *p.Regex, err)
		}
		return re, nil
	case p.String != nil:
		return regexp2.MustCompile(regexp.QuoteMeta(*p.String), regexp2.None), nil
	}
	return nil, fmt.Errorf("pattern has neither String nor Regex")
}

// ---- normalizers ----

type normalizer interface{ normalize(string) string }

type normalizerFunc func(string) string

func (f normalizerFunc) normalize(s string) string { return f(s) }

type normalizerSeq []normalizer

func (q normalizerSeq) normalize(s string) string {
	for _, n := range q {
		s = n.normalize(s)
	}
	return s
}

func parseNormalizer(raw json.RawMessage) (normalizer, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, err
	}
	var n struct {
		Normalizers []json.RawMessage `json:"normalizers"`
		Prepend     string            `json:"prepend"`
		Pattern     pattern           `json:"pattern"`
		Content     string            `json:"content"`
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var seq normalizerSeq
		for _, sub := range n.Normalizers {
			s, err := parseNormalizer(sub)
			if err != nil {
				return nil, err
			}
			if s != nil {
				seq = append(seq, s)
			}
		}
		return seq, nil
	case "NFC":
		return normalizerFunc(norm.NFC.String), nil
	case "NFD":
		return normalizerFunc(norm.NFD.String), nil
	case "NFKC":
		return normalizerFunc(norm.NFKC.String), nil
	case "NFKD":
		return normalizerFunc(norm.NFKD.String), nil
	case "Lowercase":
		return normalizerFunc(strings.ToLower), nil
	case "Prepend":
		p := n.Prepend
		return normalizerFunc(func(s string) string {
			if s == "" {
				return s
			}
			return p + s
		}), nil
	case "Replace":
		re, err := n.Pattern.compile()
		if err != nil {
			return nil, err
		}
		content := n.Content
		return normalizerFunc(func(s string) string {
			out, err := re.Replace(s, content, -1, -1)
			if err != nil {
				return s
			}
			return out
		}), nil
	}
	return nil, fmt.Errorf("unsupported normalizer type %q", typ)
}

// ---- pre-tokenizers ----

// preTokenizer refines a list of pieces into a finer list.
type preTokenizer interface {
	split(pieces []string) []string
}

type preSeq []preTokenizer

func (q preSeq) split(p []string) []string {
	for _, s := range q {
		p = s.split(p)
	}
	return p
}

func parsePreTokenizer(raw json.RawMessage) (preTokenizer, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, err
	}
	var p struct {
		Pretokenizers    []json.RawMessage `json:"pretokenizers"`
		AddPrefixSpace   *bool             `json:"add_prefix_space"`
		UseRegex         *bool             `json:"use_regex"`
		Pattern          pattern           `json:"pattern"`
		Behavior         string            `json:"behavior"`
		Invert           bool              `json:"invert"`
		Replacement      string            `json:"replacement"`
		PrependScheme    string            `json:"prepend_scheme"`
		Split            *bool             `json:"split"`
		IndividualDigits bool              `json:"individual_digits"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var seq preSeq
		for _, sub := range p.Pretokenizers {
			s, err := parsePreTokenizer(sub)
			if err != nil {
				return nil, err
			}
			if s != nil {
				seq = append(seq, s)
			}
		}
		return seq, nil
	case "ByteLevel":
		bl := &byteLevel{addPrefixSpace: p.AddPrefixSpace != nil && *p.AddPrefixSpace}
		if p.UseRegex == nil || *p.UseRegex {
			bl.re = regexp2.MustCompile(gpt2Pattern, regexp2.Unicode)
		}
		return bl, nil
	case "Split":
		if p.Invert {
			return nil, fmt.Errorf("Split with invert=true is not supported")
		}
		re, err := p.Pattern.compile()
		if err != nil {
			return nil, err
		}
		switch p.Behavior {
		case "Isolated", "Removed", "MergedWithPrevious", "MergedWithNext":
		default:
			return nil, fmt.Errorf("Split behavior %q is not supported", p.Behavior)
		}
		return &splitter{re: re, behavior: p.Behavior}, nil
	case "Metaspace":
		m := &metaspace{replacement: p.Replacement, prepend: true, cut: p.Split == nil || *p.Split}
		if m.replacement == "" {
			m.replacement = "▁"
		}
		if p.PrependScheme == "never" || (p.PrependScheme == "" && p.AddPrefixSpace != nil && !*p.AddPrefixSpace) {
			m.prepend = false
		}
		return m, nil
	case "Digits":
		expr := `\p{N}+`
		if p.IndividualDigits {
			expr = `\p{N}`
		}
		return &splitter{re: regexp2.MustCompile(expr, regexp2.Unicode), behavior: "Isolated"}, nil
	}
	return nil, fmt.Errorf("unsupported pre-tokenizer type %q", typ)
}

// splitter is the Split pre-tokenizer: it cuts each piece at the matches of
// a regex and keeps matches and gaps according to behavior.
type splitter struct {
	re       *regexp2.Regexp
	behavior string
}

func (s *splitter) split(pieces []string) []string {
	var out []string
	for _, p := range pieces {
		out = s.splitOne(out, p)
	}
	return out
}

func (s *splitter) splitOne(out []string, text string) []string {
	runes := []rune(text)
	prev := 0
	pending := "" // a match waiting to be merged with the next gap
	emit := func(str string) {
		if str != "" {
			out = append(out, str)
		}
	}
	m, _ := s.re.FindRunesMatch(runes)
	for ; m != nil; m, _ = s.re.FindNextMatch(m) {
		if m.Length == 0 {
			continue
		}
		gap, match := string(runes[prev:m.Index]), string(runes[m.Index:m.Index+m.Length])
		prev = m.Index + m.Length
		switch s.behavior {
		case "Isolated":
			emit(gap)
			emit(match)
		case "Removed":
			emit(gap)
		case "MergedWithPrevious":
			emit(gap + match)
		case "MergedWithNext":
			emit(pending + gap)
			pending = match
		}
	}
	emit(pending + string(runes[prev:]))
	return out
}

// byteLevel is GPT-2's pre-tokenizer: optional regex split, then each
// piece's bytes spelled with the byte↔rune table.
type byteLevel struct {
	addPrefixSpace bool
	re             *regexp2.Regexp
}

func (b *byteLevel) split(pieces []string) []string {
	if b.addPrefixSpace && len(pieces) > 0 && !strings.HasPrefix(pieces[0], " ") {
		pieces = append([]string{" " + pieces[0]}, pieces[1:]...)
	}
	if b.re != nil {
		pieces = (&splitter{re: b.re, behavior: "Isolated"}).split(pieces)
	}
	out := make([]string, len(pieces))
	for i, p := range pieces {
		var sb strings.Builder
		for j := 0; j < len(p); j++ {
			sb.WriteRune(byteToRune[p[j]])
		}
		out[i] = sb.String()
	}
	return out
}

// metaspace is SentencePiece's convention: spaces become "▁", a "▁" is
// prepended, and pieces are cut before each "▁".
type metaspace struct {
	replacement string
	prepend     bool
	cut         bool
}

func (m *metaspace) split(pieces []string) []string {
	var out []string
	for _, p := range pieces {
		p = strings.ReplaceAll(p, " ", m.replacement)
		if m.prepend && !strings.HasPrefix(p, m.replacement) {
			p = m.replacement + p
		}
		if !m.cut {
			out = append(out, p)
			continue
		}
		for len(p) > 0 {
			i := strings.Index(p[len(m.replacement):], m.replacement)
			if i < 0 {
				out = append(out, p)
				break
			}
			cut := i + len(m.replacement)
			out = append(out, p[:cut])
			p = p[cut:]
		}
	}
	return out
}

// ---- decoders ----

// decoder maps the list of token strings to the list of their texts.
type decoder interface {
	decode(tokens []string) []string
}

type decoderFunc func([]string) []string

func (f decoderFunc) decode(t []string) []string { return f(t) }

func parseDecoder(raw json.RawMessage) (decoder, error) {
	typ, ok, err := typeOf(raw)
	if err != nil || !ok {
		return nil, err
	}
	var d struct {
		Decoders       []json.RawMessage `json:"decoders"`
		Pattern        pattern           `json:"pattern"`
		Content        string            `json:"content"`
		Start          int               `json:"start"`
		Stop           int               `json:"stop"`
		Replacement    string            `json:"replacement"`
		PrependScheme  string            `json:"prepend_scheme"`
		AddPrefixSpace *bool             `json:"add_prefix_space"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, err
	}
	switch typ {
	case "Sequence":
		var seq []decoder
		for _, sub := range d.Decoders {
			s, err := parseDecoder(sub)
			if err != nil {
				return nil, err
			}
			if s != nil {
				seq = append(seq, s)
			}
		}
		return decoderFunc(func(t []string) []string {
			for _, s := range seq {
				t = s.decode(t)
			}
			return t
		}), nil
	case "ByteLevel":
		return decoderFunc(decodeByteLevel), nil
	case "ByteFallback":
		return decoderFunc(decodeByteFallback), nil
	case "Fuse":
		return decoderFunc(func(t []string) []string { return []string{strings.Join(t, "")} }), nil
	case "Replace":
		re, err := d.Pattern.compile()
		if err != nil {
			return nil, err
		}
		content := d.Content
		return decoderFunc(func(t []string) []string {
			out := make([]string, len(t))
			for i, s := range t {
				out[i], _ = re.Replace(s, content, -1, -1)
			}
			return out
		}), nil
	case "Strip":
		content, start, stop := d.Content, d.Start, d.Stop
		return decoderFunc(func(t []string) []string {
			out := make([]string, len(t))
			for i, s := range t {
				for n := 0; n < start && strings.HasPrefix(s, content); n++ {
					s = s[len(content):]
				}
				for n := 0; n < stop && strings.HasSuffix(s, content); n++ {
					s = s[:len(s)-len(content)]
				}
				out[i] = s
			}
			return out
		}), nil
	case "Metaspace":
		repl := d.Replacement
		if repl == "" {
			repl = "▁"
		}
		prepend := d.PrependScheme != "never" && (d.AddPrefixSpace == nil || *d.AddPrefixSpace)
		return decoderFunc(func(t []string) []string {
			out := make([]string, len(t))
			for i, s := range t {
				s = strings.ReplaceAll(s, repl, " ")
				if i == 0 && prepend {
					s = strings.TrimPrefix(s, " ")
				}
				out[i] = s
			}
			return out
		}), nil
	}
	return nil, fmt.Errorf("unsupported decoder type %q", typ)
}

// decodeByteLevel maps the byte↔rune table back to raw bytes.
func decodeByteLevel(toks []string) []string {
	var b []byte
	for _, t := range toks {
		for _, r := range t {
			if c, ok := runeToByte[r]; ok {
				b = append(b, c)
			} else {
				b = utf8.AppendRune(b, r)
			}
		}
	}
	return []string{string(b)}
}

// decodeByteFallback turns runs of <0xXX> tokens back into bytes.
func decodeByteFallback(toks []string) []string {
	out := make([]string, 0, len(toks))
	var pending []byte
	flush := func() {
		if pending != nil {
			out = append(out, string(pending))
			pending = nil
		}
	}
	for _, t := range toks {
		if len(t) == 6 && strings.HasPrefix(t, "<0x") && t[5] == '>' {
			if v, err := strconv.ParseUint(t[3:5], 16, 8); err == nil {
				pending = append(pending, byte(v))
				continue
			}
		}
		flush()
		out = append(out, t)
	}
	flush()
	return out
}
