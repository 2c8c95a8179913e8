// Package rdma holds the RDMA link's integration test (TestRDMA...): two
// QEMU TCG guests joined by a -netdev stream over a Unix socket, each with
// SoftRoCE (rdma_rxe) on its eth0, run perftest and ibv_rc_pingpong as the
// oracle and then the relay's RDMA link (cmd/shunt-rdma, built with the
// tag rdma) streaming seeded bytes both ways, checksummed
// (TestRDMASoftRoCE); and hostd's relay over that link end to end, each
// VM a host with hostd and a namespace guest (TestRDMAHostd,
// hostd-agent.sh, the guest program in guest/). See docs/rdma.md.
package rdma
