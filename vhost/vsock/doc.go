// Package vsock is a virtio-vsock device (virtio 1.2 §5.10 "Socket
// Device") served over vhost-user (vhost/vhostuser), for QEMU's
// vhost-user-vsock-pci: the host end of a guest's AF_VSOCK streams to CID
// 2, without the kernel's vhost-vsock (which this host's kernel lacks).
//
//	Device     the device: its CID (the config space), the rx and tx
//	           virtqueues (vhost/virtq), the stream protocol (REQUEST,
//	           RESPONSE, RW, SHUTDOWN, RST, CREDIT_UPDATE/REQUEST) with
//	           buf_alloc/fwd_cnt credit both ways
//	Conn       a stream, as a net.Conn: a guest's connection accepted by a
//	           Listener, or the host's Dial to a guest's listener
//	Hybrid     Firecracker's and Cloud Hypervisor's "hybrid vsock" Unix
//	           socket face (CONNECT <port>, OK <port>; guest connections
//	           to PATH_<port>) over the same device
//
// The guest is untrusted: the packets its driver writes are checked (its
// own CID as source, the host as destination, stream type, a len within
// the buffer and MaxPayload, credit respected) and a violation resets that
// connection only; the virtqueues themselves are checked by vhost/virtq.
// Every buffer is bounded: a connection's receive buffer by the credit it
// advertises, its send buffer by SendBuf, connections by MaxConns,
// unanswered control packets by maxLoose. docs/vsock.md has the rest.
package vsock
