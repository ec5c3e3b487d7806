package checkpoint

import (
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// TestZooConfigs: the architecture zoo's Qwen3, Qwen3-MoE, Mixtral and
// Gemma 3 configs parse to what their config.json says, and the parameter
// count equals the checkpoint's tensors.
func TestZooConfigs(t *testing.T) {
	load := func(name string) *Config {
		c, err := LoadConfig(shared.Path(t, "models/archzoo/"+name))
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	q3 := load("qwen3-rand")
	if !q3.QKNorm || q3.HeadDim != 48 || !q3.TieEmbeddings || q3.MoE != nil || q3.Window(0) != 0 || q3.Rope.Theta != 1e6 {
		t.Errorf("qwen3: %+v", q3)
	}
	moe := load("qwen3moe-rand")
	if want := (MoE{Experts: 8, TopK: 2, Intermediate: 96, NormTopK: true, SparseStep: 1}); moe.MoE == nil || moe.MoE.Experts != want.Experts ||
		moe.MoE.TopK != want.TopK || moe.MoE.Intermediate != want.Intermediate || moe.MoE.NormTopK != want.NormTopK || !moe.Sparse(0) || !moe.Sparse(1) || !moe.QKNorm {
		t.Errorf("qwen3moe: %+v %+v", moe, moe.MoE)
	}
	mx := load("mixtral-rand")
	if mx.MoE == nil || mx.MoE.Experts != 4 || mx.MoE.TopK != 2 || mx.MoE.Intermediate != 192 || !mx.MoE.NormTopK || mx.QKNorm || mx.HeadDim != 32 {
		t.Errorf("mixtral: %+v %+v", mx, mx.MoE)
	}
	g := load("gemma3-rand")
	if !g.QKNorm || !g.NormPlusOne || !g.SandwichNorm || g.Act != "gelu_pytorch_tanh" || g.QueryPreAttnScalar != 32 ||
		g.Window(0) != 64 || g.Window(1) != 0 || g.LayerRope(0).Theta != 1e4 || g.LayerRope(1).Theta != 1e6 || !g.TieEmbeddings {
		t.Errorf("gemma3: %+v", g)
	}
	for _, name := range []string{"qwen3-rand", "qwen3moe-rand", "mixtral-rand", "gemma3-rand", "mistral-swa-rand"} {
		ck, err := Open(shared.Path(t, "models/archzoo/"+name))
		if err != nil {
			t.Fatal(err)
		}
		var n int64
		for _, tn := range ck.Names() {
			tt, _ := ck.Tensor(tn)
			n += int64(tt.Numel())
		}
		if got := ck.Config.Params(); got != n {
			t.Errorf("%s: Params() = %d, the checkpoint holds %d", name, got, n)
		}
		ck.Close()
	}
}

// TestZooConfigRefusals: settings of the new families that change the
// computation and are not implemented are refused, naming the field.
func TestZooConfigRefusals(t *testing.T) {
	base := `"hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 10`
	cases := map[string]string{
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "final_logit_softcapping": 30.0}`:                                                                                "final_logit_softcapping",
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "attn_logit_softcapping": 50.0}`:                                                                                 "attn_logit_softcapping",
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "use_bidirectional_attention": true}`:                                                                            "use_bidirectional_attention",
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "attention_bias": true}`:                                                                                         "attention_bias",
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "layer_types": ["full_attention"]}`:                                                                              "layer_types has 1 entries for 2 layers",
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "layer_types": ["full_attention", "chunked"]}`:                                                                   `layer_types[1] "chunked"`,
		`{"architectures": ["Gemma3ForCausalLM"], ` + base + `, "hidden_activation": "gelu"}`:                                                                                    `hidden_act "gelu"`,
		`{"architectures": ["Qwen3ForCausalLM"], ` + base + `, "use_sliding_window": true}`:                                                                                      "use_sliding_window",
		`{"architectures": ["Qwen3ForCausalLM"], ` + base + `, "attention_bias": true}`:                                                                                          "attention_bias",
		`{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8}`:                                       "num_experts_per_tok 5",
		`{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_experts_per_tok": 2}`:                                                                   "moe_intermediate_size",
		`{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_local_experts": 8, "num_experts_per_tok": 2}`:                                           "num_experts 4 and num_local_experts 8",
		`{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "mlp_only_layers": [2]}`:               "mlp_only_layers: layer 2",
		`{"architectures": ["Qwen3MoeForCausalLM"], ` + base + `, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}`: "shared_expert_intermediate_size",
		`{"architectures": ["MixtralForCausalLM"], ` + base + `}`:                                                                                                                "num_experts must be a positive integer",
		`{"architectures": ["LlamaForCausalLM"], ` + base + `, "rope_parameters": {"full_attention": {"rope_theta": 1e6}}}`:                                                      "per layer type",
		`{"architectures": ["Gemma3ForConditionalGeneration"]}`:                                                                                                                  "text_config",
	}
	for in, want := range cases {
		if _, err := ParseConfig([]byte(in)); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("ParseConfig(%s) = %v, want an error mentioning %q", in, err, want)
		}
	}
}

// TestGemma3Defaults: a Gemma 3 config that leaves fields out gets
// transformers' Gemma3TextConfig defaults, and the transformers-5 rope
// style (rope_parameters per layer type) equals the transformers-4 one.
func TestGemma3Defaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{"architectures": ["Gemma3ForConditionalGeneration"], "torch_dtype": "bfloat16", "eos_token_id": [1, 106],
		"text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
		"rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Heads != 8 || c.KVHeads != 4 || c.HeadDim != 256 || c.Vocab != 262208 || c.QueryPreAttnScalar != 256 || !c.TieEmbeddings ||
		c.DType != "bfloat16" || len(c.EOS) != 2 || c.BOS != 2 || c.Window(0) != 1024 || c.Window(5) != 0 || c.Window(6) != 1024 ||
		c.Rope != (Rope{Theta: 1e6, Type: "linear", Factor: 8}) || *c.LocalRope != (Rope{Theta: 1e4, Type: "default", Factor: 1}) {
		t.Errorf("gemma-3-4b style config parsed as %+v (local rope %+v)", c, c.LocalRope)
	}
	v5, err := ParseConfig([]byte(`{"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 2,
		"num_attention_heads": 4, "head_dim": 16, "vocab_size": 10, "layer_types": ["sliding_attention", "full_attention"],
		"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}, "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}`))
	if err != nil {
		t.Fatal(err)
	}
	if v5.LayerRope(1) != (Rope{Theta: 1e6, Type: "linear", Factor: 8}) || v5.LayerRope(0) != (Rope{Theta: 1e4, Type: "default", Factor: 1}) {
		t.Errorf("transformers-5 rope_parameters: full %+v sliding %+v", v5.LayerRope(1), v5.LayerRope(0))
	}
}
