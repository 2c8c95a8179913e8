//go:build linux

package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// cdir holds the C side's files in the VM (phase cdir): shunt-run,
// libshunt-preload.so, shunt-edge and shunt-vstretchd, put into the
// initramfs at the host's paths by TestVsockPreload; the VM's /usr is the
// host's (9p), so iperf3 and libc come from there.
var cdir string

// edgePace is SHUNT_EDGE_PACE_US of cedgeflip's stream (TestVsockPreload
// gives its server's end the same): 10 ms after each write call, of 48 KB
// on average, so its 24 MiB last at least 5 s while the test flips.
const edgePace = 10000

// vstretchdSock is where shunt-vstretchd listens (the C library's default).
const vstretchdSock = "/run/shunt/vstretchd.sock"

// startVstretchd starts shunt-vstretchd (its log on the console) and waits
// up to 10 s for its socket.
func startVstretchd() error {
	cmd := exec.Command(filepath.Join(cdir, "shunt-vstretchd"), "-v", "-socket", vstretchdSock)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return err
	}
	go prefixed("SHUNT-VSOCK VSTRETCHD ", out)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(vstretchdSock); err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("shunt-vstretchd: no socket %s after 10 s", vstretchdSock)
		}
	}
}

func prefixed(prefix string, r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fmt.Println(prefix + sc.Text())
	}
}

// preloaded runs an unmodified program under shunt-run -v with vsock
// stretches on (SHUNT_VSOCK=1), at most 100 s; its output goes to the
// console line by line (prefixed), and is returned.
func preloaded(env []string, args ...string) (string, error) {
	return preloadedAs(nil, append([]string{"SHUNT_VSOCK=1"}, env...), args...)
}

// preloadedAs is preloaded with env alone (no SHUNT_VSOCK), as the user
// cred says (nil: root).
func preloadedAs(cred *syscall.Credential, env []string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(cdir, "shunt-run"), append([]string{"-v"}, args...)...)
	cmd.Env = append(append(os.Environ(), "SHUNT_PRELOAD="+filepath.Join(cdir, "libshunt-preload.so")), env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var all strings.Builder
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Println("SHUNT-VSOCK C " + sc.Text())
			all.WriteString(sc.Text() + "\n")
		}
	}()
	err := cmd.Run()
	pw.Close()
	<-done
	return all.String(), err
}

// cedge is the VM's end of TestVsockPreload's checksummed streams:
// shunt-edge's "stream" test (each end sends n bytes of a seeded stream
// and checks the other's byte for byte) to target:port; pace (µs after
// each write call, SHUNT_EDGE_PACE_US) makes it last while the test flips
// its path. The line starts "SHUNT-VSOCK name".
func cedge(name string, port uint32, n int64, seed uint64, pace int) error {
	return cedgeAs(name, nil, []string{"SHUNT_VSOCK=1"}, port, n, seed, pace)
}

// nobody is the user cedgectl runs as: a server's worker after setuid
// (nginx's), which no file of the VM's grants anything.
var nobody = &syscall.Credential{Uid: 65534, Gid: 65534}

// cedgeAs is cedge with env alone (no SHUNT_VSOCK unless env says so), as
// the user cred says (nil: root).
func cedgeAs(name string, cred *syscall.Credential, env []string, port uint32, n int64, seed uint64, pace int) error {
	out, err := preloadedAs(cred, append(env, fmt.Sprintf("SHUNT_EDGE_SEED=%d", seed), fmt.Sprintf("SHUNT_EDGE_BYTES=%d", n), fmt.Sprintf("SHUNT_EDGE_PACE_US=%d", pace)),
		filepath.Join(cdir, "shunt-edge"), "client", target, fmt.Sprint(port), "stream")
	verdict := "FAIL"
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "PASS") || strings.HasPrefix(l, "FAIL") {
			verdict = l
		}
	}
	fmt.Printf("SHUNT-VSOCK %s port=%d err=%v %s\n", name, port, err, verdict)
	return nil
}

// ciperf is the VM's end of TestVsockIperf3: iperf3's client under
// shunt-run, secs seconds, to target:port, with -R (the server sends) if
// reverse. Its line gives iperf3's exit and its sender and receiver
// summaries.
func ciperf(port uint32, secs int64, reverse bool) error {
	args := []string{"iperf3", "-c", target, "-p", fmt.Sprint(port), "-t", fmt.Sprint(secs), "-f", "m"}
	if reverse {
		args = append(args, "-R")
	}
	out, err := preloaded(nil, args...)
	// The server may be another VM booted at once, not listening yet
	// (TestVsockIperf3VMToVM): refused connects are tried again, 30 s.
	for deadline := time.Now().Add(30 * time.Second); err != nil && strings.Contains(out, "unable to connect") && time.Now().Before(deadline); {
		time.Sleep(200 * time.Millisecond)
		out, err = preloaded(nil, args...)
	}
	sum := ""
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "sender") || strings.Contains(l, "receiver") {
			sum += strings.Join(strings.Fields(l), " ") + "; "
		}
	}
	fmt.Printf("SHUNT-VSOCK ciperf port=%d reverse=%v err=%v %s\n", port, reverse, err, sum)
	return nil
}

// ciperfd is the server VM's end of TestVsockIperf3VMToVM: iperf3's
// server under shunt-run on port, in the background until the VM stops;
// it returns once the server listens (at most 30 s).
func ciperfd(port uint32) error {
	cmd := exec.Command(filepath.Join(cdir, "shunt-run"), "-v", "iperf3", "-s", "-p", fmt.Sprint(port))
	cmd.Env = append(os.Environ(), "SHUNT_VSOCK=1", "SHUNT_PRELOAD="+filepath.Join(cdir, "libshunt-preload.so"))
	if err := startListening(cmd, "iperf3 -s", port); err != nil {
		return err
	}
	fmt.Printf("SHUNT-VSOCK ciperfd port=%d listening\n", port)
	return nil
}

// startListening starts cmd, a server under shunt-run, in the background
// until the VM stops, its output on the console as "SHUNT-VSOCK C"
// lines, and returns once it listens on port (at most 30 s).
func startListening(cmd *exec.Cmd, name string, port uint32) error {
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return err
	}
	go prefixed("SHUNT-VSOCK C ", out)
	for deadline := time.Now().Add(30 * time.Second); !tcpListening(port); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			return fmt.Errorf("%s does not listen on %d after 30 s", name, port)
		}
	}
	return nil
}

// tcpListening reports whether a TCP socket listens on port here
// (/proc/net/tcp and tcp6: state 0A).
func tcpListening(port uint32) bool {
	want := fmt.Sprintf(":%04X", port)
	for _, p := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(b), "\n") {
			f := strings.Fields(l)
			if len(f) > 3 && strings.HasSuffix(f[1], want) && f[3] == "0A" {
				return true
			}
		}
	}
	return false
}
