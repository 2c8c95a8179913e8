// Package container holds what puts containers on Shunt the way the
// container ecosystem does it (docs/containers.md): cni, the CNI plugin's
// logic (cmd/shunt-cni), and cdi, the CDI spec that injects the control
// socket and the preload library.
package container
