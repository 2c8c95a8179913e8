// Package prototest has sample control messages, one of every type, for the
// Go tests of the protocol and the cross-language tests against the C
// implementation.
package prototest

import (
	"net/netip"

	"github.com/shuntnet/shunt/internal/proto"
)

// A and B are sample addresses, one IPv4 and one IPv6.
var (
	A = netip.MustParseAddrPort("10.77.1.2:40001")
	B = netip.MustParseAddrPort("[fd00::3]:5201")
)

// Samples returns one message of every type, with every field set to a
// value that exercises its width.
func Samples() []proto.Msg {
	return []proto.Msg{
		{Type: proto.Hello, PID: 4242, Formats: 1<<2 | proto.CapResume},
		{Type: proto.Welcome, GuestID: 7, Gen: 3, RegionSize: 64 << 20, Region: "/dev/shm/shunt-tenant", Formats: 1 << 2},
		{Type: proto.Listen, Local: A},
		{Type: proto.Unlisten, Local: B},
		{Type: proto.Intent, Local: A, Remote: B},
		{Type: proto.Open, ReqID: 9, Role: proto.Passive, Local: B, Remote: A},
		{Type: proto.Ready, ReqID: 9, RegionID: 3, Slot: 4, Gen: 11, Capacity: 1 << 20, RingAB: 1 << 16, RingBA: 1<<16 + 1<<20 + 1024, Side: proto.SideB},
		{Type: proto.TCP, ReqID: 10, Reason: proto.ReasonPolicy},
		{Type: proto.Close, ReqID: 12, RegionID: 3, Slot: 4, Gen: 11, Side: proto.SideA},
		{Type: proto.Release, RegionID: 1 << 31, Slot: 4, Gen: 11},
		{Type: proto.Revoke, RegionID: 3, Slot: 4, Gen: 1 << 40, Reason: proto.ReasonConntrackGone},
		{Type: proto.Kick, RegionID: 3, Slot: 4, Gen: 11, Side: proto.SideB},
		{Type: proto.Ping, Nonce: 1 << 60},
		{Type: proto.Pong, Nonce: 5},
		{Type: proto.Reattach, ReqID: 13, RegionID: 2, Slot: 1, Gen: 2, Side: proto.SideA, Local: A, Remote: B},
		{Type: proto.Error, Reason: proto.ReasonMalformed, Text: "bad frame"},
		{Type: proto.RegionMsg, RegionID: 5, RegionSize: 16 << 20},
		{Type: proto.Unregion, RegionID: 5},
		{Type: proto.Down, ReqID: 9, RegionID: 3, Slot: 4, Gen: 11, Reason: proto.ReasonFirewall},
		{Type: proto.Left, ReqID: 9, RegionID: 3, Slot: 4, Gen: 11, Side: proto.SideB},
		{Type: proto.Resume, ReqID: 9, RegionID: 3, Slot: 4, Gen: 11, Reason: proto.ReasonPeerUnreachable, Offset: 1<<40 + 7},
		{Type: proto.Ended, ReqID: 9, RegionID: 3, Slot: 4, Gen: 11, Side: proto.SideB, Offset: 1<<40 + 9},
	}
}

// SamplesV2 returns one version-2 message of every type version 2 had
// whose layout differs from version 3's, for the tests that an older
// library is still understood (and told ReasonVersion).
func SamplesV2() []proto.Msg {
	return []proto.Msg{
		{Version: 2, Type: proto.Hello, PID: 4242},
		{Version: 2, Type: proto.Welcome, GuestID: 7, Gen: 3, RegionSize: 64 << 20, Region: "/dev/shm/shunt-tenant"},
		{Version: 2, Type: proto.Close, RegionID: 3, Slot: 4, Gen: 11, Side: proto.SideA},
		{Version: 2, Type: proto.Reattach, RegionID: 2, Slot: 1, Gen: 2, Side: proto.SideA, Local: A, Remote: B},
		{Version: 2, Type: proto.Open, ReqID: 9, Role: proto.Active, Local: A, Remote: B},
		{Version: 2, Type: proto.TCP, ReqID: 9, Reason: proto.ReasonVersion},
	}
}
