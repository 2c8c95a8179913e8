//go:build linux

package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer c.Close()
			line, err := bufio.NewReader(c).ReadString('\n')
			if err != nil {
				return
			}
			fmt.Printf("SHUNT-VSOCK EXEC %s\n", strings.TrimSpace(line))
			cmd := exec.Command("/bin/sh", "-c", line)
			cmd.Env, cmd.Dir = env, filepath.Clean("/tmp")
			cmd.Stdout, cmd.Stderr = c, c
			err = cmd.Run()
			fmt.Printf("SHUNT-VSOCK EXEC-EXIT %v\n", err)
		}()
	}
}
