//go:build linux

package vsock_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/hashicorp/go-hclog"

	"github.com/shuntnet/shunt/hostd/vsockd"
)

// vsockdProc is a shunt-vsockd the test started.
type vsockdProc struct {
	sock string
	cmd  *exec.Cmd
	out  lockedBuffer
}

// startVsockd builds and starts shunt-vsockd with its control socket in
// dir, and returns once it answers there; it is killed by its pid when
// the test ends.
func startVsockd(t testing.TB, dir string) *vsockdProc {
	bin := filepath.Join(dir, "shunt-vsockd")
	if out, err := exec.Command("go", "build", "-o", bin, "../../cmd/shunt-vsockd").CombinedOutput(); err != nil {
		t.Fatalf("build shunt-vsockd: %v\n%s", err, out)
	}
	p := &vsockdProc{sock: filepath.Join(dir, "vsockd.sock")}
	p.cmd = exec.Command(bin, "-socket", p.sock, "-log-level", "debug")
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { p.cmd.Wait(); close(exited) }()
	t.Cleanup(func() { p.cmd.Process.Kill(); <-exited })
	// Answers once it listens: a probe without a hello holds nothing.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for {
		c, err := vsockd.Start(ctx, hclog.NewNullLogger(), p.sock, nil)
		if c != nil {
			c.Close()
		}
		if err == nil {
			return p
		}
		select {
		case <-exited:
			t.Fatalf("shunt-vsockd exited: %s", p.out.String())
		case <-ctx.Done():
			t.Fatalf("shunt-vsockd does not answer at %s: %v\n%s", p.sock, err, p.out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
}
