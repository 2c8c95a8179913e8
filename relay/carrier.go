package relay

// Carrier is what the relay needs of a link between two hosts, whatever
// carries it: the TCP link (Link) or the RDMA link (RDMALink). Both give
// the same Flow (flows.go), so a relay picks one per peer (RDMA when both
// hosts have a device and the setup succeeds, TCP otherwise) and drives
// its flows the same way. Nothing picks yet: the relay is not built
// (docs/crosshost.md, docs/rdma.md).
type Carrier interface {
	// Open opens flow id; the peer opens the same id.
	Open(id uint32) (*Flow, error)
	// Err is why the link ended; nil while it runs.
	Err() error
	// Stats are the link's counters.
	Stats() Stats
	// Dropped counts frames for flows not open here.
	Dropped() uint64
	// Close ends the link: every flow fails.
	Close()
	// Wait waits for the link's goroutines after it ended.
	Wait()
}

var (
	_ Carrier = (*Link)(nil)
	_ Carrier = (*RDMALink)(nil)
)
