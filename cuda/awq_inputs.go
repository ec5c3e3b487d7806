package cuda

// The four linear inputs AWQ scales (cuda.Calibrator's AWQ methods), in
// the order of its groups: q/k/v's (the attention norm's output), o's (the
// attention output), gate/up's (the MLP norm's output) and down's (the
// gated activation).
const (
	InQKV = iota
	InO
	InGateUp
	InDown
)
