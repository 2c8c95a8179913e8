// Package dist holds what operators install: the systemd unit
// (shunt-hostd.service), an example configuration (hostd.hcl) and a Grafana
// dashboard for hostd's metrics (grafana-dashboard.json), kept valid by
// tests. The shunt-host Debian package (packaging/) installs all three.
//
// The package's Go code reads the dashboard: which metric names its PromQL
// queries select, so tests can check each against a live scrape.
package dist
