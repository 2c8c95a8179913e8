// Package ibv is the RDMA link's verbs layer on real devices: a small C
// shim over libibverbs (rdma-core), called through cgo, that gives one RC
// queue pair with its registered ring and send buffer as a relay.Verbs.
//
// It is built only with the build tag rdma (and cgo), so hostd and the
// rest of Shunt build and run on hosts without rdma-core; without the tag
// Open returns ErrNoRDMA and callers use the TCP link. Build with
// `go build -tags rdma` where libibverbs-dev is installed (scripts/deps.sh
// test). Device discovery, which needs no library, is relay.RDMADevices.
package ibv
