// Package crosshost holds the cross-host integration tests
// (TestAcrossHosts..., docs/crosshost.md): two hosts of an nsrig.Fabric,
// each with its own hostd, peered over the fabric.
package crosshost
