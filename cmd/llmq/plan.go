package main

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// planFlags are quantize's mixed-precision flags: --override
// PATTERN=BITS[:GROUP] and --skip PATTERN, in the order given (the first
// rule matching a module wins).
type planFlags struct {
	rules []string // "+PATTERN=SPEC" or "-PATTERN", in flag order
}

type ruleFlag struct {
	p    *planFlags
	skip bool
}

func (f ruleFlag) String() string { return "" }
func (f ruleFlag) Type() string {
	if f.skip {
		return "PATTERN"
	}
	return "PATTERN=BITS[:GROUP]"
}
func (f ruleFlag) Set(v string) error {
	prefix := "+"
	if f.skip {
		prefix = "-"
	}
	f.p.rules = append(f.p.rules, prefix+v)
	return nil
}

// patternRegexp turns a flag's pattern into the regular expression stored
// in the config: "re:EXPR" is used as it is; anything else is a glob (*
// any characters, dots included; ? one character) matched against the
// whole module name, with or without its "model." prefix.
func patternRegexp(p string) (string, error) {
	if expr, ok := strings.CutPrefix(p, "re:"); ok {
		if _, err := regexp.Compile(expr); err != nil {
			return "", err
		}
		return expr, nil
	}
	if p == "" {
		return "", fmt.Errorf("empty pattern")
	}
	var b strings.Builder
	b.WriteString(`(?:model\.)?`)
	for _, r := range p {
		switch r {
		case '*':
			b.WriteString(".*")
		case '?':
			b.WriteString(".")
		default:
			b.WriteString(regexp.QuoteMeta(string(r)))
		}
	}
	b.WriteString("$")
	return b.String(), nil
}

// build turns the flags into a plan for a model, refusing a pattern that
// matches none of its quantizable modules; lmHead says whether a rule
// quantizes lm_head.
func (p *planFlags) build(cfg *checkpoint.Config) (plan pack.Dynamic, lmHead bool, err error) {
	var modules []string
	for i := 0; i < cfg.Layers; i++ {
		for _, n := range []string{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"} {
			modules = append(modules, fmt.Sprintf("model.layers.%d.%s", i, n))
		}
	}
	modules = append(modules, "lm_head")
	for _, r := range p.rules {
		skip, spec := r[0] == '-', r[1:]
		flag, pattern, value := "--skip", spec, ""
		if !skip {
			var ok bool
			flag = "--override"
			if pattern, value, ok = strings.Cut(spec, "="); !ok {
				return nil, false, fmt.Errorf("--override %q: want PATTERN=BITS or PATTERN=BITS:GROUP", spec)
			}
		}
		expr, err := patternRegexp(pattern)
		if err != nil {
			return nil, false, fmt.Errorf("%s %q: %w", flag, pattern, err)
		}
		rule := pack.Rule{Pattern: expr, Skip: skip}
		if !skip {
			bits, group, hasGroup := strings.Cut(value, ":")
			if rule.Bits, err = strconv.Atoi(bits); err != nil || (rule.Bits != 2 && rule.Bits != 3 && rule.Bits != 4 && rule.Bits != 8) {
				return nil, false, fmt.Errorf("--override %q: bits %q: want 2, 3, 4 or 8", spec, bits)
			}
			if hasGroup {
				if rule.GroupSize, err = strconv.Atoi(group); err != nil || rule.GroupSize == 0 || rule.GroupSize < -1 {
					return nil, false, fmt.Errorf("--override %q: group %q: want a positive size or -1", spec, group)
				}
			}
		}
		one := pack.Dynamic{rule}
		matched := 0
		for _, m := range modules {
			if _, ok := one.Match(m); ok {
				matched++
				if m == "lm_head" && !skip {
					lmHead = true
				}
			}
		}
		if matched == 0 {
			return nil, false, fmt.Errorf("%s %q matches no module (names look like model.layers.0.self_attn.q_proj, model.layers.3.mlp.down_proj, lm_head)", flag, pattern)
		}
		plan = append(plan, rule)
	}
	return plan, lmHead, nil
}
