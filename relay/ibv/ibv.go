package ibv

import "errors"

// Config is the queue pair Open makes.
type Config struct {
	Device   string // an RDMA device (/sys/class/infiniband); "": the first active one
	Port     int    // 0: 1
	GIDIndex int    // -1: picked from sysfs (RoCE v2, IPv4-mapped first)
	Size     int    // the ring's bytes (relay.MinRing..relay.MaxRing, a multiple of 4096)
	Depth    int    // batches in flight
}

// ErrNoRDMA is Open's error in a build without the rdma tag: the relay
// uses the TCP link.
var ErrNoRDMA = errors.New("ibv: built without RDMA (build with -tags rdma and libibverbs-dev)")
