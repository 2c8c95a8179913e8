//go:build linux

package main

import (
	"fmt"
	"net"
	"os"

	"github.com/shuntnet/shunt/internal/execserve"
)

// mpiexec is TestVsockMPI's VM end of mpirun's rsh agent (the VM has no
// ssh): it serves port over kernel TCP until the VM is stopped, running
// for each connection the shell command on its first line with its
// output going back on the connection, as cmd/shunt-vm-agent's
// exec-server does. The commands (orted, then the ranks) run with vsock
// stretches on (SHUNT_VSOCK=1, through the shunt-vstretchd that phase
// vstretchd started) and cdir first in PATH. Nothing here uses Shunt.
func mpiexec(port uint32) error {
	l, err := net.Listen("tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		return err
	}
	env := append(os.Environ(), "SHUNT_VSOCK=1", "PATH="+cdir+":/usr/bin:/bin:/usr/sbin:/sbin", "HOME=/tmp")
	fmt.Printf("SHUNT-VSOCK MPIEXEC port=%d\n", port)
	return execserve.Serve(l, env, "/tmp", func(format string, args ...any) {
		fmt.Printf("SHUNT-VSOCK "+format+"\n", args...)
	})
}
