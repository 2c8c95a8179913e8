// Package kubernetes holds what a Kubernetes node needs for Shunt
// (docs/containers.md): hostd.yaml (a ConfigMap with hostd.hcl and the
// DaemonSet), the Containerfile of its image, and cni-chain.md. None of it
// has run on a cluster here; its test checks that the ConfigMap's hostd.hcl
// is valid and that the DaemonSet gives hostd what the tested podman setup
// gives it.
package kubernetes
