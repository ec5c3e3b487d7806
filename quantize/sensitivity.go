package quantize

import (
	"context"
	"fmt"
	"math"
	"regexp"
	"sort"
	"strings"

	"github.com/llmq/llmq/llm"
	"github.com/llmq/llmq/pack"
)

// LayerCost is what quantizing one layer (or one module type) alone costs.
type LayerCost struct {
	Name   string  `json:"name"`   // a layer, or a module type ("mlp.down_proj") for every block's
	Params int     `json:"params"` // weights quantized
	Delta  float64 `json:"delta_nll"`
	PPL    float64 `json:"perplexity"`
}

// Sensitivity profiles a model before it is quantized: for each linear
// layer of each block in turn (byType: for each module type across all
// blocks), the layer is rounded to nearest on grid, the mean NLL of the
// windows is measured, and the layer restored. It returns the costs and
// the unquantized mean NLL. m must hold float32 (dense) layers.
func Sensitivity(ctx context.Context, m *llm.Model, windows [][]int, grid pack.Grid, byType bool, progress func(done, total int)) ([]LayerCost, float64, error) {
	base, err := meanNLL(ctx, m, windows)
	if err != nil {
		return nil, 0, err
	}
	groups := map[string][]*llm.Linear{}
	var order []string
	for i, b := range m.Blocks {
		for _, nl := range b.Linears() {
			name := fmt.Sprintf("model.layers.%d.%s", i, nl.Name)
			if byType {
				name = nl.Name
			}
			if _, ok := groups[name]; !ok {
				order = append(order, name)
			}
			groups[name] = append(groups[name], nl.L)
		}
	}
	var costs []LayerCost
	for k, name := range order {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		c := LayerCost{Name: name}
		var saved []llm.Linear
		for _, l := range groups[name] {
			d, ok := (*l).(*llm.Dense)
			if !ok {
				return nil, 0, fmt.Errorf("%s is not a float32 layer (profile an unquantized checkpoint)", name)
			}
			lin, err := pack.RTN(d.W, d.Out(), d.In(), grid)
			if err != nil {
				return nil, 0, fmt.Errorf("%s: %w", name, err)
			}
			saved = append(saved, *l)
			*l = llm.NewDense(lin.Dequantize(), d.B, d.In(), d.Out())
			c.Params += d.In() * d.Out()
		}
		nll, err := meanNLL(ctx, m, windows)
		for i, l := range groups[name] {
			*l = saved[i]
		}
		if err != nil {
			return nil, 0, err
		}
		c.Delta, c.PPL = nll-base, math.Exp(nll)
		costs = append(costs, c)
		if progress != nil {
			progress(k+1, len(order))
		}
	}
	return costs, base, nil
}

// meanNLL is the mean negative log-likelihood of the windows (each from an
// empty cache), the perplexity protocol's statistic.
func meanNLL(ctx context.Context, m *llm.Model, windows [][]int) (float64, error) {
	var sum float64
	n := 0
	for _, w := range windows {
		s, c, err := m.WindowNLL(ctx, w)
		if err != nil {
			return 0, err
		}
		sum, n = sum+s, n+c
	}
	if n == 0 {
		return 0, fmt.Errorf("no tokens to score")
	}
	return sum / float64(n), nil
}

// Plan is a mixed-precision plan proposed from a sensitivity profile.
type Plan struct {
	BaseBits    int          `json:"base_bits"`
	HighBits    int          `json:"high_bits"`
	TargetBits  float64      `json:"target_bits"`
	AverageBits float64      `json:"average_bits"` // over the quantized layers' weights
	Dynamic     pack.Dynamic `json:"dynamic"`      // what quantize --plan applies
	Raised      []string     `json:"raised"`       // the layers (or types) given HighBits
}

// ProposePlan raises to high bits the layers whose cost per weight is
// largest, as long as the average bits per weight stays within target:
// the greedy answer to "which layers buy the most perplexity per bit".
func ProposePlan(costs []LayerCost, base, high int, target float64) (*Plan, error) {
	if high <= base {
		return nil, fmt.Errorf("high bits %d must exceed base bits %d", high, base)
	}
	if target < float64(base) {
		return nil, fmt.Errorf("target %.2f bits is below the base %d bits", target, base)
	}
	byValue := append([]LayerCost(nil), costs...)
	sort.SliceStable(byValue, func(a, b int) bool {
		return byValue[a].Delta/float64(byValue[a].Params) > byValue[b].Delta/float64(byValue[b].Params)
	})
	var total, bits float64
	for _, c := range costs {
		total += float64(c.Params)
		bits += float64(c.Params * base)
	}
	p := &Plan{BaseBits: base, HighBits: high, TargetBits: target}
	for _, c := range byValue {
		extra := float64(c.Params * (high - base))
		if c.Delta <= 0 || (bits+extra)/total > target {
			continue
		}
		bits += extra
		p.Raised = append(p.Raised, c.Name)
		pattern := regexp.QuoteMeta(c.Name) + "$"
		if !strings.HasPrefix(c.Name, "model.") { // a module type: every block's
			pattern = `model\.layers\.\d+\.` + pattern
		}
		p.Dynamic = append(p.Dynamic, pack.Rule{Pattern: pattern, Bits: high})
	}
	p.AverageBits = bits / total
	return p, nil
}
