package main

import "github.com/llmq/llmq/pack"

// openModel loads dir's checkpoint (packed or not) and tokenizer for the CPU
// backend.
func openModel(dir string) (*pack.Model, error) { return pack.OpenModel(dir) }
