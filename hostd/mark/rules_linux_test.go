//go:build linux

package mark

import (
	"bytes"
	"fmt"
	"reflect"
	"testing"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
)

// le is a 32-bit value as the kernel keeps it in a register on this
// (little-endian) machine.
func le(v uint32) []byte { return []byte{byte(v), byte(v >> 8), byte(v >> 16), byte(v >> 24)} }

// TestExprs: one guest's rule, spelled out: iifname "vnet0" ct state new
// ct mark & 0x3fff0000 == 0 counter ct mark set ct mark & 0xc000ffff ^ 0x50000.
func TestExprs(t *testing.T) {
	got := Exprs(Field{0xffff0000}, Entry{Guest: "vm1", Ifname: "vnet0", ID: 5, Value: 0x50000})
	want := []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte("vnet0\x00")},
		&expr.Ct{Key: expr.CtKeySTATE, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: le(8), Xor: le(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: le(0)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 2, Len: 4, Mask: le(0x3fff0000), Xor: le(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 2, Data: le(0)},
		&expr.Counter{},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: le(0xc000ffff), Xor: le(0x50000)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("rule for vm1 on vnet0:\n got %s\nwant %s", dump(got), dump(want))
	}
}

// TestRuleset: for N guests, both chains (forward and input, after the
// filter chains) hold one rule per guest in interface order, each naming
// its guest in a comment and matching only its interface.
func TestRuleset(t *testing.T) {
	f := Field{DefaultMask}
	var es []Entry
	for i := range 5 {
		es = append(es, Entry{Guest: fmt.Sprintf("g%d", i), Ifname: fmt.Sprintf("tap%d", i), ID: uint32(10 + i), Value: f.Value(uint32(10 + i))})
	}
	cs, rs := Ruleset(f, es)
	if len(cs) != 4 || cs[0].Name != "forward" || *cs[0].Hooknum != *nftables.ChainHookForward ||
		cs[1].Name != "input" || *cs[1].Hooknum != *nftables.ChainHookInput ||
		cs[2].Name != "proof_out" || *cs[2].Hooknum != *nftables.ChainHookPostrouting ||
		cs[3].Name != "proof_in" || *cs[3].Hooknum != *nftables.ChainHookInput {
		t.Fatalf("chains %+v, want forward, input, proof_out and proof_in", cs)
	}
	for _, c := range cs[2:] {
		if *c.Priority != ProofPriority || *c.Policy != nftables.ChainPolicyAccept {
			t.Fatalf("proof chain %s: %+v", c.Name, c)
		}
	}
	proof := rs[2*len(es):]
	if len(proof) != 4 {
		t.Fatalf("%d proof rules, want 2 per proof chain", len(proof))
	}
	rs = rs[:2*len(es)]
	cs = cs[:2]
	for _, c := range cs {
		if *c.Priority != Priority || c.Type != nftables.ChainTypeFilter || *c.Policy != nftables.ChainPolicyAccept || c.Table.Name != Table || c.Table.Family != nftables.TableFamilyINet {
			t.Fatalf("chain %s: %+v", c.Name, c)
		}
	}
	if len(rs) != 2*len(es) {
		t.Fatalf("%d rules, want %d", len(rs), 2*len(es))
	}
	for i, r := range rs {
		e := es[i%len(es)]
		if r.Chain != cs[i/len(es)] {
			t.Errorf("rule %d in chain %s, want %s", i, r.Chain.Name, cs[i/len(es)].Name)
		}
		if c, _ := userdata.GetString(r.UserData, userdata.TypeComment); c != "shunt guest "+e.Guest {
			t.Errorf("rule %d comment %q", i, c)
		}
		if !reflect.DeepEqual(r.Exprs, Exprs(f, e)) {
			t.Errorf("rule %d is not %s's", i, e.Guest)
		}
		if !bytes.Equal(r.Exprs[1].(*expr.Cmp).Data, []byte(e.Ifname+"\x00")) {
			t.Errorf("rule %d matches %q", i, r.Exprs[1].(*expr.Cmp).Data)
		}
	}
	// An interface change is the same rule with the new name.
	moved := es[2]
	moved.Ifname = "tap9"
	if got := Exprs(f, moved); !bytes.Equal(got[1].(*expr.Cmp).Data, []byte("tap9\x00")) || !reflect.DeepEqual(got[9], Exprs(f, es[2])[9]) {
		t.Fatalf("moved rule %s", dump(got))
	}
	if _, rs := Ruleset(f, nil); len(rs) != 4 {
		t.Fatalf("no guests: %d rules, want the 4 proof rules", len(rs))
	}
}

func dump(es []expr.Any) string {
	var b bytes.Buffer
	for _, e := range es {
		fmt.Fprintf(&b, "\n  %T%+v", e, e)
	}
	return b.String()
}
