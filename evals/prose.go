package evals

import _ "embed"

// Prose is about 8 KB of plain English prose written for llmq (about 2,000
// tokens with the shared models' tokenizer; no file of anyone else's): the
// text a quick perplexity is measured on when no file is given, such as
// the cost of re-quantizing a layer that llmq export gguf reports.
//
//go:embed prose.txt
var Prose string

// ProseName names Prose where a file name would go in a report.
const ProseName = "llmq's built-in prose"
