//go:build linux

package mark

import (
	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"golang.org/x/sys/unix"
)

// proofChains are the chains that set the proof bits: postrouting sees
// every packet that leaves by a real interface (forwarded between guests,
// or sent by local processes); input sees every packet delivered to a
// local socket (loopback included, after the operator's input filter,
// which postrouting on lo would run before).
func proofChains(t *nftables.Table) []*nftables.Chain {
	return []*nftables.Chain{baseChain(t, "proof_out", nftables.ChainHookPostrouting, ProofPriority),
		baseChain(t, "proof_in", nftables.ChainHookInput, ProofPriority)}
}

// proofRules are a proof chain's two rules, one per direction.
func proofRules(f Field, c *nftables.Chain) []*nftables.Rule {
	skipLo := c.Name == "proof_out"
	var rs []*nftables.Rule
	for _, dir := range []uint8{dirOriginal, dirReply} {
		rs = append(rs, &nftables.Rule{Table: c.Table, Chain: c, Exprs: ProofExprs(f, dir, skipLo),
			UserData: userdata.AppendString(nil, userdata.TypeComment, proofComment(dir))})
	}
	return rs
}

// Conntrack directions (enum ip_conntrack_dir).
const (
	dirOriginal = 0
	dirReply    = 1
)

func proofComment(dir uint8) string {
	if dir == dirOriginal {
		return "shunt proof original"
	}
	return "shunt proof reply"
}

// ProofExprs is one proof rule: a TCP packet of direction dir whose
// connection's proof bit for that direction is clear sets it.
//
//	[oifname != "lo"] meta l4proto tcp ct direction DIR
//	ct mark & BIT == 0 ct mark set ct mark | BIT
//
// The bit is written once per clearing, not per packet, so the rule costs
// a few register operations on the data path. An untracked packet has no
// ct mark and does not match.
func ProofExprs(f Field, dir uint8, skipLo bool) []expr.Any {
	ne := binaryutil.NativeEndian.PutUint32
	bit := f.PassOrig()
	if dir == dirReply {
		bit = f.PassReply()
	}
	var es []expr.Any
	if skipLo {
		es = append(es,
			&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ifname("lo")})
	}
	return append(es,
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.IPPROTO_TCP}},
		&expr.Ct{Key: expr.CtKeyDIRECTION, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{dir}},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 2, Len: 4, Mask: ne(bit), Xor: ne(0)},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 2, Data: ne(0)},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: ne(^bit), Xor: ne(bit)},
		&expr.Ct{Key: expr.CtKeyMARK, Register: 1, SourceRegister: true},
	)
}

// ifname is an interface name as meta iifname/oifname compare it: the
// kernel's IFNAMSIZ buffer, NUL-padded.
func ifname(s string) []byte {
	b := make([]byte, unix.IFNAMSIZ)
	copy(b, s)
	return b
}
