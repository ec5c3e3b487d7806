package llm

import (
	"fmt"
	"testing"
)

// TestLinearByName finds each block's layers and an untied lm_head by
// their checkpoint names, and nothing else.
func TestLinearByName(t *testing.T) {
	d := func() Linear { return NewDense(make([]float32, 4), nil, 2, 2) }
	m := &Model{LMHead: d()}
	for i := 0; i < 2; i++ {
		m.Blocks = append(m.Blocks, &Block{Q: d(), K: d(), V: d(), O: d(), Gate: d(), Up: d(), Down: d()})
	}
	for i, b := range m.Blocks {
		for _, nl := range b.Linears() {
			l, ok := m.LinearByName(fmt.Sprintf("model.layers.%d.%s", i, nl.Name))
			if !ok || l != nl.L {
				t.Errorf("block %d %s: %v %v", i, nl.Name, l, ok)
			}
		}
	}
	if l, ok := m.LinearByName("lm_head"); !ok || l != &m.LMHead {
		t.Errorf("lm_head: %v %v", l, ok)
	}
	for _, n := range []string{"model.layers.2.mlp.up_proj", "model.layers.-1.mlp.up_proj", "model.layers.x.mlp.up_proj",
		"model.layers.0.mlp.bogus", "layers.0.mlp.up_proj", "model.layers.0"} {
		if _, ok := m.LinearByName(n); ok {
			t.Errorf("%q found", n)
		}
	}
	m.TiedHead = true
	if _, ok := m.LinearByName("lm_head"); ok {
		t.Errorf("tied lm_head found")
	}
}
