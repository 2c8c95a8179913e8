// Package integration holds Shunt's end-to-end tests: hostd (the real
// binary) with real conntrack and nftables, guests in network namespaces
// (integration/nsrig) using guestlib. They need root and skip otherwise;
// under CI=true they fail instead.
package integration
