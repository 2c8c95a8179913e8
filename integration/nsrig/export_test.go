//go:build linux

package nsrig

// For tests.
var (
	TCPSegment = tcpSegment
	Checksum   = checksum
)
