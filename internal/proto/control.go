package proto

// NetnsControl is the abstract Unix socket name (without its leading NUL)
// on which hostd also serves a process or container guest that has a
// network namespace in its configuration, inside that namespace. Abstract
// names belong to a network namespace and need no file, no permission and
// no path: a process reaches it after chroot and after dropping
// privileges, and a connection to it proves that the process is in the
// guest's namespace. The Go and C libraries try it when the control
// socket's path fails (docs/preload.md, "Privileges and chroot"). Go
// writes it "@shunt/control"; C, "\0shunt/control".
const NetnsControl = "shunt/control"

// VsockControlPort is the host's vsock port (CID 2) on which hostd serves
// a VM's control channel when the VM has a vsock device: for hypervisors
// without virtio-serial (Firecracker), and for any vsock VM whose library
// finds no control port (docs/vsock.md, "The control channel"). The
// stretches' port is relay.VsockPort (1022). Both are below 1024: where
// the host's kernel serves vsock (vhost-vsock, for other devices), binding
// them needs CAP_NET_BIND_SERVICE, so an unprivileged host user cannot
// listen there and pose as hostd to a VM's library.
const VsockControlPort = 1021
