//go:build linux

package main

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"time"

	"github.com/shuntnet/shunt/guestlib"
)

// target is the address gdial connects to (phase target).
var target string

// dialFast connects to target:port through guestlib over vsock (this VM
// has no ivshmem) and waits up to 60 s for the fast path.
func dialFast(port uint32) (*guestlib.Conn, error) {
	cl, err := guestlib.NewClient(guestlib.Options{Vsock: true, Logf: func(f string, a ...any) { fmt.Printf("SHUNT-VSOCK LOG "+f+"\n", a...) }})
	if err != nil {
		return nil, err
	}
	d := guestlib.Dialer{Client: cl}
	// The target may be a VM still booting (TestVsockVMToVM): a refused
	// dial is retried, up to 60 s.
	var c *guestlib.Conn
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		c, err = d.Dial("tcp", fmt.Sprintf("%s:%d", target, port))
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) || time.Now().After(deadline) {
			break
		}
	}
	if err != nil {
		return nil, err
	}
	for deadline := time.Now().Add(60 * time.Second); !c.Path().Fast; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			c.Close()
			return nil, fmt.Errorf("not on the fast path after 60 s: %v", c.Path())
		}
	}
	fmt.Printf("SHUNT-VSOCK ONRINGS port=%d\n", port)
	return c, nil
}

// gdial is the VM's end of TestVsockProcessGuest: a guestlib connection
// to target:port, which must reach the fast path (over vsock: this VM has
// no ivshmem), then n seeded bytes each way at once, half-closes, and the
// SHA-256 of both directions.
func gdial(port uint32, n int64, seed uint64) error {
	c, err := dialFast(port)
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	sent := make(chan []byte, 1)
	go func() {
		h := sha256.New()
		_, err := io.Copy(io.MultiWriter(c, h), io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n))
		if err != nil {
			fmt.Printf("SHUNT-VSOCK ERROR write: %v\n", err)
		}
		c.CloseWrite()
		sent <- h.Sum(nil)
	}()
	h := sha256.New()
	got, err := io.Copy(h, c)
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", got, err)
	}
	st := c.Stats()
	fmt.Printf("SHUNT-VSOCK gdial port=%d sent=%x recv=%x bytes=%d ring=%d/%d tcp=%d/%d path=%v ms=%d stats=%+v\n", port, <-sent, h.Sum(nil), got,
		st.RingSent, st.RingReceived, st.TCPSent, st.TCPReceived, c.Path(), time.Since(start).Milliseconds(), st)
	return nil
}

// gflip is the VM's end of TestVsockPolicyFlips: a guestlib connection to
// target:port that must reach the fast path, then a duplex stream: the VM
// sends seeded bytes (64 KiB every 10 ms) until the other end's stream
// ends (EOF), then half-closes; the line gives both directions' length
// and SHA-256, and the connection's per-path counts.
func gflip(port uint32, seed uint64) error {
	c, err := dialFast(port)
	if err != nil {
		return err
	}
	defer c.Close()
	start := time.Now()
	eof := make(chan struct{})
	line, err := pacedDuplex(c, "gflip", port, seed, eof, readAll(c, eof), start)
	if err != nil {
		return err
	}
	fmt.Println(line)
	return nil
}

// gchild is the child gkill runs: as gflip's start (a guestlib connection
// to target:port on the fast path), then seeded bytes (64 KiB every
// 10 ms) for ever, saying how many it wrote every 16 writes; it never
// reads, so the VM's kernel holds no unread byte of the connection when
// the child is killed.
func gchild(port uint32, seed uint64) error {
	c, err := dialFast(port)
	if err != nil {
		return err
	}
	src := rand.NewChaCha8(seedBytes(seed))
	buf := make([]byte, 64<<10)
	for i := 1; ; i++ {
		src.Read(buf)
		if _, err := c.Write(buf); err != nil {
			return err
		}
		if i%16 == 0 {
			fmt.Printf("SHUNT-VSOCK CHILD wrote=%d stats=%+v\n", i*len(buf), c.Stats())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// gkill is the VM's end of TestVsockKilled: it runs gchild in a process
// of its own, and SIGKILLs it once it wrote 2 MiB on the fast path.
func gkill(port uint32, seed uint64) error {
	cmd := exec.Command("/proc/self/exe", "target:"+target+":0:0", fmt.Sprintf("gchild:%d:0:%d", port, seed))
	out, err := cmd.StdoutPipe()
	if err != nil {
		return err
	}
	if err := cmd.Start(); err != nil {
		return err
	}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line := sc.Text()
		fmt.Println(line)
		if strings.HasPrefix(line, "SHUNT-VSOCK CHILD wrote=") && !strings.HasPrefix(line, "SHUNT-VSOCK CHILD wrote=1048576 ") {
			cmd.Process.Kill()
			fmt.Printf("SHUNT-VSOCK KILLED port=%d after %s\n", port, strings.Fields(line)[2])
			go io.Copy(os.Stdout, out)
			cmd.Wait() // killed
			return nil
		}
	}
	return fmt.Errorf("the child ended: %v", cmd.Wait())
}
