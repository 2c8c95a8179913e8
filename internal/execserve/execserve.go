// Package execserve is the VM end of mpirun's rsh agent in the test VMs,
// which have no ssh: for each connection it runs the shell command on its
// first line, its output going back on the connection. Kernel TCP only;
// nothing here uses Shunt. For test guests, never for a host.
package execserve

import (
	"bufio"
	"net"
	"os/exec"
	"strings"
)

// Serve serves l until it fails. env (nil: the caller's environment) and
// dir (empty: the caller's) are each command's; logf, if set, is told
// each command as it starts ("EXEC cmd") and ends ("EXEC-EXIT err").
func Serve(l net.Listener, env []string, dir string, logf func(format string, args ...any)) error {
	if logf == nil {
		logf = func(string, ...any) {}
	}
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
			logf("EXEC %s", strings.TrimSpace(line))
			cmd := exec.Command("/bin/sh", "-c", line)
			cmd.Env, cmd.Dir = env, dir
			cmd.Stdout, cmd.Stderr = c, c
			err = cmd.Run()
			logf("EXEC-EXIT %v", err)
		}()
	}
}
