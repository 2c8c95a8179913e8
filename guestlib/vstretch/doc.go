// Package vstretch is the guest's end of a vsock stretch (docs/vsock.md,
// "The data path over vsock"): in a VM without a Shunt ivshmem device, one
// flow's switched stretch goes over an AF_VSOCK stream of its own to the
// host (CID 2, relay.VsockPort). The stretch holds a ring pair in this
// process's memory, which the guest library reads and writes as it would
// a region's, and a relay.Bridge that is those rings' peer on the stream;
// hostd's room (hostd/vsockhost) runs the other bridge, on the flow's real
// rings. So the rings' contract (start offsets, LEFT marks, nothing freed
// before the other end holds it) holds across the stream unchanged.
package vstretch
