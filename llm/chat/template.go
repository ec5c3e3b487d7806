// Package chat turns a conversation into the prompt text a chat model was
// trained on, by rendering the Jinja `chat_template` of the model's
// tokenizer_config.json exactly as transformers' apply_chat_template does
// (jinja2 with trim_blocks and lstrip_blocks, `messages`,
// `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`,
// `strftime_now`).
//
// Rendering uses github.com/ardanlabs/jinja, a Jinja engine written for
// chat templates and checked byte for byte against jinja2; this package's
// tests compare its renderings of the Llama-3, Mistral, Qwen2, Qwen3 and
// Gemma 3 templates with jinja2's (testdata/golden.json, made by
// testdata/render.py).
//
// Qwen3's template reads two things beyond roles and contents: an
// assistant message's reasoning (Message.ReasoningContent, or a
// "<think>…</think>" prefix of its content), rendered in <think> tags for
// the turns after the last user message and dropped from earlier ones,
// and the enable_thinking variable (RenderWith), false putting an empty
// think block after the generation prompt.
//
// The rendered text already holds the template's special tokens (usually
// the BOS token too), so it is tokenized without adding special tokens.
package chat

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"

	"github.com/ardanlabs/jinja"
)

// Message is one turn of a conversation.
type Message struct {
	Role    string `json:"role"` // system, user, assistant, tool
	Content string `json:"content"`
	// ReasoningContent is an assistant turn's thinking, for templates
	// that render it (Qwen3's reasoning_content); passed only when set.
	ReasoningContent string `json:"reasoning_content,omitempty"`
}

// Template is a compiled chat template with the special tokens it refers to.
type Template struct {
	Source   string
	BOSToken string
	EOSToken string
	tmpl     *jinja.Template
}

// ErrNoTemplate is returned by Load when tokenizer_config.json has no
// chat_template (a base model: prompt it with plain text instead).
var ErrNoTemplate = errors.New("no chat_template in tokenizer_config.json")

// tokenizerConfig is the part of tokenizer_config.json a template needs.
// chat_template is a string, or a list of {name, template} of which the
// one named "default" is used; special tokens are strings or AddedToken
// objects with a "content" field.
type tokenizerConfig struct {
	ChatTemplate json.RawMessage `json:"chat_template"`
	BOSToken     json.RawMessage `json:"bos_token"`
	EOSToken     json.RawMessage `json:"eos_token"`
}

// Load reads the chat template of a model directory's tokenizer_config.json.
func Load(dir string) (*Template, error) {
	path := filepath.Join(dir, "tokenizer_config.json")
	data, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s: %w", path, ErrNoTemplate)
		}
		return nil, err
	}
	t, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return t, nil
}

// Parse reads a chat template from tokenizer_config.json's contents.
func Parse(data []byte) (*Template, error) {
	var c tokenizerConfig
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("not JSON: %w", err)
	}
	src, err := templateSource(c.ChatTemplate)
	if err != nil {
		return nil, err
	}
	bos, err := tokenContent(c.BOSToken)
	if err != nil {
		return nil, fmt.Errorf("bos_token: %w", err)
	}
	eos, err := tokenContent(c.EOSToken)
	if err != nil {
		return nil, fmt.Errorf("eos_token: %w", err)
	}
	return New(src, bos, eos)
}

// New compiles a template source.
func New(src, bos, eos string) (*Template, error) {
	t, err := jinja.Compile(src)
	if err != nil {
		return nil, fmt.Errorf("chat_template: %w", err)
	}
	return &Template{Source: src, BOSToken: bos, EOSToken: eos, tmpl: t}, nil
}

func templateSource(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", ErrNoTemplate
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var named []struct{ Name, Template string }
	if err := json.Unmarshal(raw, &named); err != nil {
		return "", fmt.Errorf("chat_template: want a string or a list of {name, template}: %w", err)
	}
	for _, n := range named {
		if n.Name == "default" {
			return n.Template, nil
		}
	}
	return "", fmt.Errorf("chat_template: no template named \"default\" among %d", len(named))
}

func tokenContent(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var t struct{ Content string }
	if err := json.Unmarshal(raw, &t); err != nil {
		return "", fmt.Errorf("want a string or {\"content\": ...}: %w", err)
	}
	return t.Content, nil
}

// Render renders the conversation; addGenerationPrompt appends the
// header of the assistant's turn, what a model continues from.
func (t *Template) Render(messages []Message, addGenerationPrompt bool) (string, error) {
	return t.RenderWith(messages, addGenerationPrompt, nil)
}

// rendererVars are the variables Render sets itself.
var rendererVars = []string{"messages", "add_generation_prompt", "bos_token", "eos_token"}

// RendererVars lists the variables Render sets itself (messages,
// add_generation_prompt, bos_token, eos_token), which RenderWith's vars
// cannot replace.
func RendererVars() []string { return slices.Clone(rendererVars) }

// RenderWith is Render with further template variables, as
// apply_chat_template passes its extra keyword arguments (e.g. Qwen3's
// {"enable_thinking": false}). They cannot replace the variables Render
// sets (RendererVars).
func (t *Template) RenderWith(messages []Message, addGenerationPrompt bool, vars map[string]any) (string, error) {
	if len(messages) == 0 {
		return "", fmt.Errorf("chat template: no messages")
	}
	ms := make([]any, len(messages))
	for i, m := range messages {
		if m.Role == "" {
			return "", fmt.Errorf("chat template: message %d has no role", i)
		}
		msg := map[string]any{"role": m.Role, "content": m.Content}
		if m.ReasoningContent != "" {
			msg["reasoning_content"] = m.ReasoningContent
		}
		ms[i] = msg
	}
	ctx := map[string]any{}
	for k, v := range vars {
		if slices.Contains(rendererVars, k) {
			return "", fmt.Errorf("chat template: variable %q is set by the renderer", k)
		}
		ctx[k] = v
	}
	ctx["messages"] = ms
	ctx["add_generation_prompt"] = addGenerationPrompt
	ctx["bos_token"] = t.BOSToken
	ctx["eos_token"] = t.EOSToken
	out, err := t.tmpl.Render(ctx)
	if err != nil {
		return "", fmt.Errorf("chat template: %w", err)
	}
	return out, nil
}
