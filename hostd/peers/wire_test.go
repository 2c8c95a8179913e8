package peers

import (
	"bufio"
	"errors"
	"strings"
	"testing"
)

// TestReadMsgBounds: what a peer sends is bounded and validated: a line
// over maxLine, an announcement of too many addresses, a bad address, an
// unknown type and bad JSON are malformed; a good message reads back.
func TestReadMsgBounds(t *testing.T) {
	for name, in := range map[string]string{
		"long line":   `{"type":"ping","x":"` + strings.Repeat("a", maxLine) + "\"}\n",
		"many addrs":  `{"type":"announce","addrs":[` + strings.Repeat(`{"prefix":"10.0.0.1/32"},`, maxAddrs) + `{"prefix":"10.0.0.1/32"}]}` + "\n",
		"bad address": `{"type":"announce","addrs":[{"prefix":"300.1.1.1/32"}]}` + "\n",
		"not masked":  `{"type":"announce","addrs":[{"prefix":"10.1.1.1/8"}]}` + "\n",
		"no address":  `{"type":"announce","addrs":[{"group":"t"}]}` + "\n",
		"bad type":    `{"type":"claim"}` + "\n",
		"not json":    "hello\n",
	} {
		_, err := readMsg(bufio.NewReaderSize(strings.NewReader(in), maxLine))
		if !errors.Is(err, errMalformed) {
			t.Errorf("%s: %v, want malformed", name, err)
		}
	}
	good := appendMsg(nil, msg{Type: tRefused, Refused: []Refusal{{Reason: RefusedLocal}}})
	m, err := readMsg(bufio.NewReaderSize(strings.NewReader(string(good)), maxLine))
	if err != nil || m.Type != tRefused || m.Refused[0].Reason != RefusedLocal {
		t.Fatalf("read back %+v, %v", m, err)
	}
}
