package llm

// SetBlockTokens gives m a fresh unbounded pool of blocks of bt positions
// (before any cache is open), for tests of the paging itself.
func SetBlockTokens(m *Model, bt int) {
	m.KVPool()
	c := m.Cfg
	m.kv = NewBlockPool(c, bt, 0, int64(2*c.KVHeads*bt*c.HeadDim)*4)
}
