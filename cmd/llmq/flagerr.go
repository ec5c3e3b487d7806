package main

import (
	"errors"
	"fmt"
	"io/fs"
	"strings"

	"github.com/llmq/llmq/evals"
	"github.com/llmq/llmq/pack"
	"github.com/spf13/cobra"
)

// Library errors describe a value and what was expected, in the library's
// words (pack.GridError's "group size", evals.SynthOptionError's "Group");
// the command line says which flag gave the value.

// flagNames maps the fields library errors name to a command's flags.
type flagNames map[string]string

// withFlagErrors makes cmd's errors about a value the user gave name the
// flag that gave it (see flagError).
func withFlagErrors(cmd *cobra.Command, names flagNames) *cobra.Command {
	run := cmd.RunE
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		return flagError(cmd, run(cmd, args), names)
	}
	return cmd
}

// flagError rewrites a library error about one of the command's values as
// "--flag VALUE: want …" (keeping the error chain), says -o is required
// when the library was given no output directory, and adds the --force
// hint to an existing output directory (fs.ErrExist) when cmd has --force.
func flagError(cmd *cobra.Command, err error, names flagNames) error {
	if err == nil {
		return nil
	}
	var ge *pack.GridError
	if errors.As(err, &ge) {
		if flag, ok := names[ge.Field]; ok {
			return &flagValueError{fmt.Sprintf("%s %d: want %s", flag, ge.Value, ge.Want), err}
		}
	}
	var se *evals.SynthOptionError
	if errors.As(err, &se) {
		if flag, ok := names[se.Field]; ok {
			if se.Err != nil {
				return &flagValueError{fmt.Sprintf("%s %s: %v", flag, se.Value, se.Err), err}
			}
			return &flagValueError{fmt.Sprintf("%s %s: want %s", flag, se.Value, se.Want), err}
		}
	}
	if errors.Is(err, pack.ErrNoOutput) && cmd.Flags().Lookup("output") != nil {
		return &flagValueError{"-o OUT is required (the output directory)", err}
	}
	if errors.Is(err, fs.ErrExist) && cmd.Flags().Lookup("force") != nil && !strings.Contains(err.Error(), "--force") {
		return &flagValueError{err.Error() + "; use --force to replace it", err}
	}
	return err
}

// flagValueError is a library error restated in the command line's terms.
type flagValueError struct {
	msg string
	err error
}

func (e *flagValueError) Error() string { return e.msg }
func (e *flagValueError) Unwrap() error { return e.err }
