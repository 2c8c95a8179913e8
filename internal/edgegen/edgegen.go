// Package edgegen is the stream generator of the C edge suite's switch
// tests (integration/ctest/edge_switch.c), for the Go ends of tests that
// talk to it: each direction of a "stream SEED BYTES" test is a seeded
// xorshift byte stream.
package edgegen

// Gen yields one direction's stream.
type Gen struct {
	s    uint64
	b    [8]byte
	have int
}

// New returns direction dir's (0: the client's, 1: the server's) stream
// for seed, as edge_switch.c's gen_init.
func New(seed uint64, dir int) *Gen {
	return &Gen{s: seed*0x9e3779b97f4a7c15 + uint64(dir)*0xbf58476d1ce4e5b9 + 1}
}

// Fill writes the stream's next len(p) bytes into p.
func (g *Gen) Fill(p []byte) {
	for i := range p {
		if g.have == 0 {
			g.s ^= g.s >> 12
			g.s ^= g.s << 25
			g.s ^= g.s >> 27
			v := g.s * 0x2545f4914f6cdd1d
			for j := range g.b {
				g.b[j] = byte(v >> (8 * j))
			}
			g.have = 8
		}
		p[i] = g.b[8-g.have]
		g.have--
	}
}
