package pack

import (
	"bytes"
	"encoding/json"
	"fmt"
	"regexp"
	"strings"
)

// Rule is one entry of a mixed-precision plan, in the "dynamic" form of
// GPTQModel's quantization_config: modules whose names match Pattern (a
// regular expression matched from the start of the name, as Python's
// re.match does) are skipped — kept unquantized — or quantized with the
// rule's bits and group size instead of the config's. The first matching
// rule wins.
type Rule struct {
	Pattern   string
	Skip      bool  // "-:" in the config: not quantized
	Bits      int   // 0: the config's
	GroupSize int   // 0: the config's
	Sym       *bool // nil: the config's
	re        *regexp.Regexp
}

// Dynamic is an ordered list of rules; it reads and writes as GPTQModel's
// JSON object {"-:pattern": {}, "+:pattern": {"bits": 8, "group_size": 64}},
// keeping the order of its keys.
type Dynamic []Rule

type ruleOverride struct {
	Bits      int   `json:"bits,omitempty"`
	GroupSize int   `json:"group_size,omitempty"`
	Sym       *bool `json:"sym,omitempty"`
}

// MarshalJSON writes the rules as an object in their order.
func (d Dynamic) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, r := range d {
		if i > 0 {
			b.WriteByte(',')
		}
		key := "+:" + r.Pattern
		if r.Skip {
			key = "-:" + r.Pattern
		}
		k, _ := json.Marshal(key)
		v, err := json.Marshal(ruleOverride{Bits: r.Bits, GroupSize: r.GroupSize, Sym: r.Sym})
		if err != nil {
			return nil, err
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// UnmarshalJSON reads the object keeping the order of its keys (a key
// without a "+:" or "-:" prefix is a "+:" rule) and compiles the patterns.
func (d *Dynamic) UnmarshalJSON(data []byte) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return fmt.Errorf("dynamic: want an object of pattern → override")
	}
	var rules Dynamic
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("dynamic: %w", err)
		}
		key := tok.(string)
		var o ruleOverride
		if err := dec.Decode(&o); err != nil {
			return fmt.Errorf("dynamic %q: %w", key, err)
		}
		r := Rule{Pattern: strings.TrimPrefix(key, "+:"), Bits: o.Bits, GroupSize: o.GroupSize, Sym: o.Sym}
		if p, ok := strings.CutPrefix(key, "-:"); ok {
			r.Pattern, r.Skip = p, true
		}
		if err := r.compile(); err != nil {
			return err
		}
		rules = append(rules, r)
	}
	if _, err := dec.Token(); err != nil {
		return fmt.Errorf("dynamic: %w", err)
	}
	*d = rules
	return nil
}

func (r *Rule) compile() error {
	re, err := regexp.Compile("^(?:" + r.Pattern + ")")
	if err != nil {
		return fmt.Errorf("dynamic pattern %q: %w", r.Pattern, err)
	}
	r.re = re
	return nil
}

// Match returns the first rule matching a module name ("model.layers.3.
// mlp.down_proj", "lm_head"), if any.
func (d Dynamic) Match(name string) (Rule, bool) {
	for _, r := range d {
		if r.re == nil && r.compile() != nil {
			continue
		}
		if r.re.MatchString(name) {
			return r, true
		}
	}
	return Rule{}, false
}

// For returns the grid of a module under the rules, with base for the
// values a rule leaves unset, and whether the module is quantized at all.
func (d Dynamic) For(name string, base Grid) (Grid, bool) {
	r, ok := d.Match(name)
	if !ok {
		return base, true
	}
	if r.Skip {
		return Grid{}, false
	}
	g := base
	if r.Bits != 0 {
		g.Bits = r.Bits
	}
	if r.GroupSize != 0 {
		g.GroupSize = r.GroupSize
	}
	if r.Sym != nil {
		g.Sym = *r.Sym
	}
	return g, true
}
