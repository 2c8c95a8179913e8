// Package hostd is the root of Shunt's host daemon. The daemon keeps TCP
// connection setup on the kernel stack and hands each established, allowed
// flow to the shared-memory data path; it is off the data path itself.
//
// Its packages (config, broker, ctrack, witness, virt, server, preflight,
// admin, metrics, agent, dist) are listed with the rest of the tree in
// docs/DESIGN.md, the project's one layout table.
//
// The command itself, agent and CLI, is cmd/hostd.
package hostd
