package quantize

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/llmq/llmq/llm/checkpoint"
	"github.com/llmq/llmq/pack"
)

// modelCard is the README.md of an output: what it was made from, how,
// and how to load it.
func modelCard(opt Options, ck *checkpoint.Checkpoint, qc *pack.QuantConfig, rep *Report) string {
	var b strings.Builder
	base := baseModel(opt.Src)
	g := qc.Grid()
	if qc.CT != nil {
		g = opt.Method.Grid()
	}
	group := fmt.Sprintf("groups of %d", g.GroupSize)
	if g.GroupSize <= 0 {
		group = "one group per output channel"
	}
	sym := "asymmetric (a zero point per group)"
	if g.Sym {
		sym = "symmetric"
	}
	if g.FP8 {
		group, sym = "FP8 E4M3 with a scale per output channel", "symmetric"
		if g.PerTensor {
			group = "FP8 E4M3 with one scale per layer"
		}
	}
	fmt.Fprintf(&b, "---\nbase_model: %s\ntags:\n- llmq\n- %s\n- %d-bit\n---\n\n", base, rep.Method, g.Bits)
	fmt.Fprintf(&b, "# %s, %d-bit %s\n\n", base, g.Bits, strings.ToUpper(rep.Method))
	fmt.Fprintf(&b, "%s (%s, %d layers) with the linear layers of every decoder block quantized by llmq to %d bits, %s, %s, with %s. ",
		base, ck.Config.Architecture, ck.Config.Layers, g.Bits, group, sym, methodName(rep.Method))
	kept := "Embeddings, norms and lm_head keep their dtype"
	if opt.QuantizeLMHead {
		kept = "lm_head is quantized too; embeddings and norms keep their dtype"
	}
	if strings.HasPrefix(rep.Method, "awq") {
		kept += " (norms that AWQ's scales were folded into are stored as F32)"
	}
	b.WriteString(kept + ".\n\n")
	fmt.Fprintf(&b, "- layout: %s (`quant_method` %q", layoutName(qc), qc.QuantMethod)
	if qc.CheckpointFormat != "" {
		fmt.Fprintf(&b, ", `checkpoint_format` %q", qc.CheckpointFormat)
	}
	b.WriteString(" in config.json's quantization_config)\n")
	if rep.CalibTokens > 0 {
		fmt.Fprintf(&b, "- calibration: %s, the first %d windows of %d tokens (%d tokens)\n", filepath.Base(opt.Calib), opt.NSamples, opt.SeqLen, rep.CalibTokens)
	}
	fmt.Fprintf(&b, "- size: %.1f MB of weights, from %.1f MB\n", float64(rep.BytesOut)/1e6, float64(rep.BytesIn)/1e6)
	if opt.Version != "" {
		fmt.Fprintf(&b, "- made by llmq %s\n", opt.Version)
	}
	if opt.CommandLine != "" {
		fmt.Fprintf(&b, "\n```\n%s\n```\n", opt.CommandLine)
	}
	b.WriteString("\nllmq runs it (`llmq generate DIR --prompt …`, `llmq serve DIR`).")
	if (g.Bits == 4 || qc.CT != nil) && !opt.QuantizeLMHead && qc.CheckpointFormat != "gptq_v2" {
		b.WriteString(" Engines that read the " + layoutName(qc) + " layout (transformers, vLLM) load it.")
	}
	b.WriteString("\n")
	return b.String()
}

func methodName(m string) string {
	switch m {
	case "rtn":
		return "round-to-nearest"
	case "gptq":
		return "GPTQ (Frantar et al. 2022)"
	case "awq":
		return "AWQ (Lin et al. 2023)"
	case "awq+gptq":
		return "AWQ's scales folded in, then GPTQ"
	}
	return m
}

func layoutName(qc *pack.QuantConfig) string {
	if qc.CT != nil {
		return "compressed-tensors " + qc.CT.Format
	}
	if qc.QuantMethod == "awq" {
		return "AutoAWQ GEMM"
	}
	return "GPTQ"
}

// baseModel is the source's Hugging Face name (config.json's
// _name_or_path when it is a hub name, not a local path), else the
// directory's name.
func baseModel(src string) string {
	var cfg struct {
		Name string `json:"_name_or_path"`
	}
	if data, err := os.ReadFile(filepath.Join(src, "config.json")); err == nil && json.Unmarshal(data, &cfg) == nil &&
		cfg.Name != "" && !strings.HasPrefix(cfg.Name, "/") && !strings.HasPrefix(cfg.Name, ".") {
		return cfg.Name
	}
	return filepath.Base(filepath.Clean(src))
}
