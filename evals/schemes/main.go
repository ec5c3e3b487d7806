// Command schemes assembles the quantization-scheme table that
// evals/schemes.sh measures (issue 17, point 8): one row per scheme with
// its perplexity (from the row's `llmq eval ppl --json` record) and the
// bytes of its weights (from its checkpoint's tensors), written as a JSON
// record and a markdown table.
//
//	go run ./evals/schemes -manifest build/schemes/llama-tiny/rows.tsv \
//	    -command "evals/schemes.sh ../shared/models/llama-tiny" -o evals/results/schemes-llama-tiny
//
// Each manifest line is tab-separated: id, scheme, weights, activations,
// checkpoint directory, ppl JSON, the quantize record(s) that made the
// checkpoint (comma-separated, or -), and a note.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/llm/checkpoint"
)

// Row is one scheme of the table.
type Row struct {
	ID          string  `json:"id"`
	Scheme      string  `json:"scheme"`
	Weights     string  `json:"weights"`
	Activations string  `json:"activations"`
	Note        string  `json:"note,omitempty"`
	Perplexity  float64 `json:"perplexity"`
	VsBaseline  float64 `json:"vs_baseline"` // relative to the first row
	Windows     int     `json:"windows"`
	SeqLen      int     `json:"seqlen"`
	// WeightBytes is every tensor of the checkpoint as stored (packed
	// codes, scales, zeros, g_idx, embeddings, norms, lm_head);
	// LinearBytes only the decoder blocks' linear layers (what the scheme
	// quantizes).
	WeightBytes int64          `json:"weight_bytes"`
	LinearBytes int64          `json:"linear_bytes"`
	Checkpoint  string         `json:"checkpoint"`
	Eval        evals.Record   `json:"eval"`
	Made        []evals.Record `json:"made_by,omitempty"`
}

func main() {
	manifest := flag.String("manifest", "", "rows.tsv written by evals/schemes.sh")
	command := flag.String("command", "", "the command that produced the table (recorded)")
	out := flag.String("o", "", "output path without extension (.json and .md are written)")
	title := flag.String("title", "", "a line above the markdown table")
	commands := flag.String("commands", "", "a file of the commands run, one a line (recorded)")
	flag.Parse()
	if *manifest == "" || *out == "" {
		flag.Usage()
		os.Exit(2)
	}
	if err := run(*manifest, *command, *commands, *out, *title); err != nil {
		fmt.Fprintln(os.Stderr, "schemes:", err)
		os.Exit(1)
	}
}

func readRecord(path string) (evals.Record, error) {
	var r evals.Record
	b, err := os.ReadFile(path)
	if err != nil {
		return r, err
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}

// weightBytes sums the checkpoint's tensors: all of them, and those of
// the decoder blocks' linear layers.
func weightBytes(dir string) (all, linear int64, err error) {
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return 0, 0, err
	}
	defer ck.Close()
	for _, n := range ck.Names() {
		t, err := ck.Tensor(n)
		if err != nil {
			return 0, 0, err
		}
		all += int64(len(t.Data))
		if strings.HasPrefix(n, "model.layers.") && (strings.Contains(n, "_proj.") || strings.Contains(n, ".experts.")) {
			linear += int64(len(t.Data))
		}
	}
	return all, linear, nil
}

func run(manifest, command, commandsFile, out, title string) error {
	b, err := os.ReadFile(manifest)
	if err != nil {
		return err
	}
	var rows []Row
	commits, devices, backends := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for i, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Split(line, "\t")
		if len(f) != 8 {
			return fmt.Errorf("%s:%d: %d fields, want 8", manifest, i+1, len(f))
		}
		r := Row{ID: f[0], Scheme: f[1], Weights: f[2], Activations: f[3], Checkpoint: f[4], Note: strings.TrimPrefix(f[7], "-")}
		if r.Eval, err = readRecord(f[5]); err != nil {
			return err
		}
		var res struct {
			Result  evals.PPLResult `json:"result"`
			Backend string          `json:"backend"`
		}
		raw, _ := json.Marshal(r.Eval.Data)
		if err := json.Unmarshal(raw, &res); err != nil {
			return fmt.Errorf("%s: %w", f[5], err)
		}
		r.Perplexity, r.Windows, r.SeqLen = res.Result.Perplexity, res.Result.Windows, res.Result.SeqLen
		if !(r.Perplexity > 0) || math.IsInf(r.Perplexity, 0) {
			return fmt.Errorf("%s: perplexity %v", f[5], r.Perplexity)
		}
		if f[6] != "-" {
			for _, p := range strings.Split(f[6], ",") {
				rec, err := readRecord(p)
				if err != nil {
					return err
				}
				r.Made = append(r.Made, rec)
			}
		}
		if r.WeightBytes, r.LinearBytes, err = weightBytes(r.Checkpoint); err != nil {
			return err
		}
		commits[r.Eval.Commit], devices[r.Eval.Device], backends[res.Backend] = true, true, true
		rows = append(rows, r)
	}
	if len(rows) == 0 {
		return fmt.Errorf("%s: no rows", manifest)
	}
	for i := range rows {
		rows[i].VsBaseline = rows[i].Perplexity/rows[0].Perplexity - 1
		if i > 0 && (rows[i].Windows != rows[0].Windows || rows[i].SeqLen != rows[0].SeqLen) {
			return fmt.Errorf("row %s: %d windows of %d, the first row %d of %d", rows[i].ID, rows[i].Windows, rows[i].SeqLen, rows[0].Windows, rows[0].SeqLen)
		}
	}
	rec := evals.Record{Kind: "schemes", Command: command, Commit: joinKeys(commits), Device: joinKeys(devices),
		Date: time.Now().UTC().Format(time.RFC3339), Data: map[string]any{"rows": rows, "backends": joinKeys(backends)}}
	if commandsFile != "" {
		c, err := os.ReadFile(commandsFile)
		if err != nil {
			return err
		}
		rec.Data["commands"] = strings.Split(strings.TrimSpace(string(c)), "\n")
	}
	data, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(out+".json", append(data, '\n'), 0o644); err != nil {
		return err
	}
	return os.WriteFile(out+".md", []byte(markdown(rec, rows, title)), 0o644)
}

func joinKeys(m map[string]bool) string {
	var k []string
	for s := range m {
		k = append(k, s)
	}
	sort.Strings(k)
	return strings.Join(k, " + ")
}

func mb(n int64) string { return fmt.Sprintf("%.2f MB", float64(n)/1e6) }

func markdown(rec evals.Record, rows []Row, title string) string {
	var s strings.Builder
	if title != "" {
		fmt.Fprintf(&s, "%s\n\n", title)
	}
	fmt.Fprintf(&s, "| scheme | weights | activations | perplexity | vs %s | weights (all tensors) | decoder linear layers |\n", rows[0].Scheme)
	s.WriteString("|---|---|---|---:|---:|---:|---:|\n")
	for i, r := range rows {
		vs := "—"
		if i > 0 {
			vs = fmt.Sprintf("%+.2f%%", 100*r.VsBaseline)
		}
		fmt.Fprintf(&s, "| %s | %s | %s | %.3f | %s | %s | %s |\n", r.Scheme, r.Weights, r.Activations, r.Perplexity, vs, mb(r.WeightBytes), mb(r.LinearBytes))
	}
	fmt.Fprintf(&s, "\nWikiText-2 test, %d windows of %d tokens, evaluated by %s. `%s`, llmq %s, %s.\n", rows[0].Windows, rows[0].SeqLen,
		rec.Data["backends"], rec.Command, rec.Commit, rec.Device)
	var notes []string
	for _, r := range rows {
		if r.Note != "" {
			notes = append(notes, fmt.Sprintf("- %s: %s", r.Scheme, r.Note))
		}
	}
	if len(notes) > 0 {
		s.WriteString("\n" + strings.Join(notes, "\n") + "\n")
	}
	return s.String()
}
