// Package admin is hostd's admin socket: one JSON request per connection,
// one JSON reply, on a Unix socket only root can reach. The commands are
// the Cmd constants (status, guests, flows, counters, reload, revoke);
// `hostd <command>` is the client (Call), and the agent answers them.
package admin
