// Package relaytest has fakes of the relay's lower layers for other
// packages' tests: Verbs, an in-process RC queue pair pair whose "NIC"
// can hold writes, so that a test of hostd's relay can keep a write that
// reads a guest's ring in flight (docs/rdma.md, "Sending side").
//
// relay's own tests keep their fake (relay/fakeverbs_test.go): they are
// in package relay, which cannot import this package (it imports relay).
package relaytest
