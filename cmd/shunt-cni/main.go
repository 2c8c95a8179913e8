// Command shunt-cni is the CNI plugin `shunt` (installed as bin/cni/shunt,
// /usr/lib/cni/shunt): chained after the plugin that makes a container's
// interface, it registers the container with hostd as a guest (ADD),
// checks it (CHECK) and removes it (DEL). docs/containers.md.
package main

import (
	"github.com/containernetworking/cni/pkg/skel"

	"github.com/shuntnet/shunt/container/cni"
)

func main() {
	p := &cni.Plugin{HostPeer: cni.HostPeer}
	skel.PluginMainFuncs(skel.CNIFuncs{Add: p.Add, Del: p.Del, Check: p.Check, Status: p.Status}, cni.Versions,
		"shunt: puts a container's TCP connections on Shunt's shared-memory rings (registers it with hostd)")
}
