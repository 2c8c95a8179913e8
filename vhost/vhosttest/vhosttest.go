//go:build linux

// Package vhosttest starts real QEMU processes for the vhost tests: paused
// (-S) under TCG with no guest, which is enough for QEMU to realize the
// devices, map their memory and connect their sockets.
package vhosttest

import (
	"bytes"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/shuntnet/shunt/internal/testenv"
)

// QEMU starts qemu-system-x86_64 with the device arguments; it is killed
// when the test ends. The buffer collects its output.
func QEMU(t testing.TB, devices ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	testenv.NeedTool(t, "qemu-system-x86_64", "qemu-system-x86")
	var out bytes.Buffer
	cmd := exec.Command("qemu-system-x86_64", append([]string{"-machine", "pc,accel=tcg", "-m", "64", "-nodefaults",
		"-display", "none", "-monitor", "none", "-serial", "none", "-S"}, devices...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, &out
}

// WaitMapped waits until QEMU has mapped the file at path.
func WaitMapped(t testing.TB, cmd *exec.Cmd, out *bytes.Buffer, path string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		maps, err := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/maps")
		if err != nil {
			t.Fatalf("QEMU exited: %v\n%s", err, out.String())
		}
		if strings.Contains(string(maps), path) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("QEMU did not map %s:\n%s", path, out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}
