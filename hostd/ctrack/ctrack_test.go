package ctrack_test

import (
	"net/netip"
	"testing"

	"github.com/shuntnet/shunt/hostd/ctrack"
)

// TestTupleUnmap: an IPv4 tuple in IPv4-mapped form (an AF_INET6
// socket's names) is the IPv4 tuple; IPv6 tuples are unchanged.
func TestTupleUnmap(t *testing.T) {
	ap := netip.MustParseAddrPort
	for _, tc := range []struct{ in, want ctrack.Tuple }{
		{ctrack.Tuple{ap("[::ffff:10.77.1.2]:4000"), ap("[::ffff:10.77.2.2]:5201")}, ctrack.Tuple{ap("10.77.1.2:4000"), ap("10.77.2.2:5201")}},
		{ctrack.Tuple{ap("10.77.1.2:4000"), ap("10.77.2.2:5201")}, ctrack.Tuple{ap("10.77.1.2:4000"), ap("10.77.2.2:5201")}},
		{ctrack.Tuple{ap("[fd00:77:1::2]:4000"), ap("[fd00:77:2::2]:5201")}, ctrack.Tuple{ap("[fd00:77:1::2]:4000"), ap("[fd00:77:2::2]:5201")}},
		{ctrack.Tuple{ap("[fe80::1%eth0]:4000"), ap("[fe80::2%eth0]:5201")}, ctrack.Tuple{ap("[fe80::1]:4000"), ap("[fe80::2]:5201")}},
	} {
		if got := tc.in.Unmap(); got != tc.want {
			t.Errorf("%s.Unmap() = %s, want %s", tc.in, got, tc.want)
		}
	}
}
