//go:build linux

package nsrig

// For tests.
var (
	TCPSegment  = tcpSegment
	TCPSegment6 = tcpSegment6
	Checksum    = checksum
)
