package chat

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmq/llmq/internal/shared"
)

// TestTemplatesMatchJinja2 renders the Llama-3, Llama-3.1, Mistral,
// Qwen2, Qwen3 and Gemma 3 templates on each case of testdata/cases.json
// and compares with jinja2's renderings (testdata/golden.json, from
// testdata/render.py).
func TestTemplatesMatchJinja2(t *testing.T) {
	var cases []struct {
		Name                string
		AddGenerationPrompt bool `json:"add_generation_prompt"`
		Messages            []Message
		Vars                map[string]any
	}
	read(t, "testdata/cases.json", &cases)
	var golden map[string]string
	read(t, "testdata/golden.json", &golden)
	tokens := map[string][2]string{
		"llama3": {"<|begin_of_text|>", "<|eot_id|>"}, "llama31": {"<|begin_of_text|>", "<|eot_id|>"},
		"mistral": {"<s>", "</s>"}, "qwen2": {"", "<|im_end|>"}, "qwen3": {"", "<|im_end|>"},
		"gemma3": {"<bos>", "<eos>"},
	}
	n := 0
	for name, tok := range tokens {
		src, err := os.ReadFile(filepath.Join("testdata", name+".jinja"))
		if err != nil {
			t.Fatal(err)
		}
		tmpl, err := New(strings.TrimSuffix(string(src), "\n"), tok[0], tok[1])
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, c := range cases {
			key := name + "/" + c.Name
			want, ok := golden[key]
			if !ok {
				t.Fatalf("golden.json has no %s: rerun testdata/render.py", key)
			}
			got, err := tmpl.RenderWith(c.Messages, c.AddGenerationPrompt, c.Vars)
			if err != nil {
				got = "ERROR: " + strings.TrimPrefix(err.Error(), "chat template: ")
			}
			if strings.HasPrefix(want, "ERROR: ") {
				// The engine words its errors its own way; the raised
				// message must be there.
				if err == nil || !strings.Contains(err.Error(), strings.TrimPrefix(want, "ERROR: ")) {
					t.Errorf("%s: want error %q, got %q", key, want, got)
				}
			} else if got != want {
				t.Errorf("%s:\n got %q\nwant %q", key, got, want)
			}
			n++
		}
	}
	if n != len(golden) {
		t.Errorf("compared %d renderings, golden.json has %d", n, len(golden))
	}
}

func read(t *testing.T, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

func TestLoadSharedModel(t *testing.T) {
	tmpl, err := Load(shared.Path(t, "models/llama-tiny"))
	if err != nil {
		t.Fatal(err)
	}
	got, err := tmpl.Render([]Message{{Role: "user", Content: "Hi"}}, true)
	if err != nil {
		t.Fatal(err)
	}
	want := "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
	if got != want {
		t.Errorf("got %q, want %q", got, want)
	}
	if tmpl.BOSToken != "<|begin_of_text|>" || tmpl.EOSToken != "<|end_of_text|>" {
		t.Errorf("special tokens %q %q", tmpl.BOSToken, tmpl.EOSToken)
	}
}

func TestParseForms(t *testing.T) {
	tmpl, err := Parse([]byte(`{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}{{ messages[0].content }}"}],
		"bos_token": {"content": "<s>", "lstrip": false}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := tmpl.Render([]Message{{Role: "user", Content: "x"}}, false); got != "<s>x" {
		t.Errorf("named template with AddedToken bos: %q", got)
	}
	for _, c := range []struct{ json, want string }{
		{`{}`, "no chat_template"},
		{`{"chat_template": 3}`, "want a string or a list"},
		{`{"chat_template": [{"name": "rag", "template": "x"}]}`, `no template named "default"`},
		{`{"chat_template": "{% for m in messages %}"}`, "chat_template"},
		{`{"chat_template": "x", "bos_token": 5}`, "bos_token"},
		{`not json`, "not JSON"},
	} {
		_, err := Parse([]byte(c.json))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: got %v, want an error containing %q", c.json, err, c.want)
		}
	}
	if _, err := Load(t.TempDir()); !errors.Is(err, ErrNoTemplate) || !strings.Contains(err.Error(), "tokenizer_config.json") {
		t.Errorf("missing file: %v", err)
	}
	if _, err := tmpl.Render(nil, true); err == nil {
		t.Error("no messages: want an error")
	}
}

// FuzzRender: whatever a client sends as roles and contents, the
// published templates render without panicking, and a message's content
// reaches the prompt (the Llama-3, Qwen2 and Gemma 3 templates insert it
// verbatim or trimmed) unless the template refuses the conversation.
func FuzzRender(f *testing.F) {
	var tmpls []*Template
	for _, name := range []string{"llama3", "qwen2", "mistral", "gemma3"} {
		src, err := os.ReadFile(filepath.Join("testdata", name+".jinja"))
		if err != nil {
			f.Fatal(err)
		}
		tmpl, err := New(strings.TrimSuffix(string(src), "\n"), "<s>", "</s>")
		if err != nil {
			f.Fatal(err)
		}
		tmpls = append(tmpls, tmpl)
	}
	f.Add("user", "Hello!", "assistant", "Hi {{ there }} {% if %}", true)
	f.Add("system", "  be brief \n", "user", "\x00\xff<|eot_id|>", false)
	f.Fuzz(func(t *testing.T, r1, c1, r2, c2 string, gen bool) {
		msgs := []Message{{Role: r1, Content: c1}, {Role: r2, Content: c2}}
		for i, tmpl := range tmpls {
			out, err := tmpl.Render(msgs, gen)
			if err != nil || i == 2 { // Mistral's template reorders system text
				continue
			}
			for _, m := range msgs {
				if c := strings.TrimSpace(m.Content); !strings.Contains(out, c) {
					t.Fatalf("template %d: content %q missing from %q", i, c, out)
				}
			}
		}
	})
}

// TestQwen3AndGemma3Turns spells out what the published Qwen3 and Gemma 3
// templates (testdata/qwen3.jinja, gemma3.jinja: the zoo checkpoints carry
// no tokenizer_config.json) make of one conversation, as transformers'
// apply_chat_template renders it: Qwen3 drops the thinking of turns before
// the last user message, shows it in <think> tags after it, and with
// enable_thinking false opens the answer with an empty think block; Gemma
// 3 folds the system prompt into the first user turn and calls the
// assistant "model".
func TestQwen3AndGemma3Turns(t *testing.T) {
	load := func(name, bos, eos string) *Template {
		src, err := os.ReadFile(filepath.Join("testdata", name+".jinja"))
		if err != nil {
			t.Fatal(err)
		}
		tmpl, err := New(strings.TrimSuffix(string(src), "\n"), bos, eos)
		if err != nil {
			t.Fatal(err)
		}
		return tmpl
	}
	qwen3, gemma3 := load("qwen3", "", "<|im_end|>"), load("gemma3", "<bos>", "<eos>")
	conv := []Message{{Role: "system", Content: "Be brief."}, {Role: "user", Content: "2+2?"},
		{Role: "assistant", Content: "<think>\nAdd.\n</think>\n\n4"}, {Role: "user", Content: "3+3?"}}
	q := "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n" +
		"<|im_start|>user\n3+3?<|im_end|>\n"
	for _, c := range []struct {
		tmpl *Template
		msgs []Message
		gen  bool
		vars map[string]any
		want string
	}{
		{qwen3, conv, true, nil, q + "<|im_start|>assistant\n"},
		{qwen3, conv, true, map[string]any{"enable_thinking": false}, q + "<|im_start|>assistant\n<think>\n\n</think>\n\n"},
		{qwen3, append(conv[:4:4], Message{Role: "assistant", Content: "6", ReasoningContent: "Add again."}), false, nil,
			q + "<|im_start|>assistant\n<think>\nAdd again.\n</think>\n\n6<|im_end|>\n"},
		{gemma3, conv, true, nil, "<bos><start_of_turn>user\nBe brief.\n\n2+2?<end_of_turn>\n<start_of_turn>model\n<think>\nAdd.\n</think>\n\n4<end_of_turn>\n" +
			"<start_of_turn>user\n3+3?<end_of_turn>\n<start_of_turn>model\n"},
	} {
		got, err := c.tmpl.RenderWith(c.msgs, c.gen, c.vars)
		if err != nil || got != c.want {
			t.Errorf("got %q, %v\nwant %q", got, err, c.want)
		}
	}
	for _, name := range RendererVars() {
		if _, err := qwen3.RenderWith(conv, true, map[string]any{name: nil}); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("a variable overriding %s: error %v", name, err)
		}
	}
}
