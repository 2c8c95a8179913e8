// Package proto is Shunt's control protocol, version 1: the messages between
// a guest (the Go guestlib, the preload library, or a VM agent) and hostd,
// over one stream channel per guest (a Unix socket for a process guest, a
// virtio-serial port for a VM). The channel is the guest's identity: hostd
// never trusts an id or address a message claims.
//
// Every message is a frame:
//
//	0      1      2             4                     8
//	+------+------+-------------+---------------------+------------------+
//	| ver  | type | reserved(0) | payload length (LE) | payload ...      |
//	+------+------+-------------+---------------------+------------------+
//
// ver is 1; a payload is at most MaxPayload bytes and exactly as long as its
// type requires (strings are a u16 length and bytes). A frame that breaks any
// rule is ErrMalformed and the receiver closes the channel. See
// docs/protocol.md for each message and the flow lifecycle.
package proto
