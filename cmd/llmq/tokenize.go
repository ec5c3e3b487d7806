package main

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"

	"github.com/llmq/llmq/llm/tokenizer"
	"github.com/spf13/cobra"
)

func newTokenize() *cobra.Command {
	var format, out string
	var special bool
	cmd := &cobra.Command{
		Use:   "tokenize MODEL_DIR FILE",
		Short: "Encode a text file with the model's tokenizer.json",
		Example: `  llmq tokenize ../shared/models/llama-tiny notes.txt
  llmq tokenize ../shared/models/llama-tiny wiki.test.raw --format i32 -o wiki.i32`,
		Args: cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			if format != "text" && format != "i32" {
				return fmt.Errorf("--format must be text or i32, got %q", format)
			}
			tok, err := tokenizer.Load(filepath.Join(args[0], "tokenizer.json"))
			if err != nil {
				return err
			}
			text, err := os.ReadFile(args[1])
			if err != nil {
				return err
			}
			ids := tok.Encode(string(text), special)
			w := cmd.OutOrStdout()
			if out != "" {
				f, err := os.Create(out)
				if err != nil {
					return err
				}
				defer f.Close()
				w = f
			}
			bw := bufio.NewWriter(w)
			if format == "i32" {
				var b [4]byte
				for _, id := range ids {
					binary.LittleEndian.PutUint32(b[:], uint32(int32(id)))
					bw.Write(b[:])
				}
			} else {
				for i, id := range ids {
					if i > 0 {
						bw.WriteByte(' ')
					}
					fmt.Fprint(bw, id)
				}
				bw.WriteByte('\n')
			}
			if err := bw.Flush(); err != nil {
				return err
			}
			fmt.Fprintf(os.Stderr, "%d tokens\n", len(ids))
			return nil
		},
	}
	cmd.Flags().StringVar(&format, "format", "text", "output format: text (space-separated ids) or i32 (little-endian int32)")
	cmd.Flags().StringVarP(&out, "output", "o", "", "write to this file instead of stdout")
	cmd.Flags().BoolVar(&special, "special", false, "add the post-processor's special tokens (BOS)")
	return cmd
}
