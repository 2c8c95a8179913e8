// Package vsock holds TestVhostUserVsock: a QEMU (TCG) guest with
// vhost-user-vsock-pci, served by vhost/vsock, streams checked bytes to
// and from the host through the device's Go face and its hybrid Unix
// socket face. It is a package of its own so that its VM boot does not add
// to the integration package's run time.
package vsock
