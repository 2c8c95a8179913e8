// Package dist holds what operators install: the systemd unit
// (shunt-hostd.service) and an example configuration (hostd.hcl), kept
// valid by a test.
package dist
