// Package cni is the logic of the CNI plugin `shunt` (cmd/shunt-cni): it is
// chained after the plugin that makes the container's interface, and
// registers the container with hostd as a guest at run time (ADD), checks
// it is there (CHECK) and removes it (DEL), over hostd's admin socket. It
// passes the previous plugin's result through unchanged.
package cni
