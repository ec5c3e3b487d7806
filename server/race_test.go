//go:build race

package server

// raceEnabled: the race detector slows JSON decoding and HTTP far more
// than the model, so timing comparisons mean nothing under it.
const raceEnabled = true
