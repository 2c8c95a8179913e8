// Command guest is TestRDMAHostd's program in a namespace guest of each
// VM host, a Go program on guestlib (SHUNT_CONTROL names its hostd's
// control socket):
//
//	guest serve ADDR          echo one connection, then exit
//	guest dial ADDR N PHASES DIR
//
// dial sends N seeded bytes in PHASES equal parts and checks the echo
// byte for byte against the seed as it comes (so both directions are
// checked: a byte lost or repeated either way is a mismatch). After the
// echo of part k is whole it creates DIR/atK and waits for DIR/goK (the
// agent's: it flips policy or breaks the RDMA link meanwhile) before it
// sends part k+1. Every wait has a deadline; it prints GUEST OK or GUEST
// FAIL with the byte counts.
//
//	guest exec-server PORT    run the shell command each connection sends
//	                          (one line), its output back on the connection
//	guest rsh PORT HOST CMD   run CMD at HOST's exec server, its output here
//
// exec-server and rsh are mpirun's rsh agent between the VM hosts'
// guests (TestRDMAMPI), over kernel TCP: the VMs have no ssh.
package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/shuntnet/shunt/guestlib"
	"github.com/shuntnet/shunt/internal/execserve"
)

// deadline bounds each wait: generous, for TCG guests on a loaded machine.
const deadline = 4 * time.Minute

func main() {
	var err error
	switch {
	case len(os.Args) == 3 && os.Args[1] == "serve":
		err = serve(os.Args[2])
	case len(os.Args) == 6 && os.Args[1] == "dial":
		n, e1 := strconv.Atoi(os.Args[3])
		phases, e2 := strconv.Atoi(os.Args[4])
		if e1 != nil || e2 != nil || n <= 0 || phases <= 0 {
			err = errors.New("dial ADDR N PHASES DIR")
			break
		}
		err = dial(os.Args[2], n, phases, os.Args[5])
	case len(os.Args) == 3 && os.Args[1] == "exec-server":
		err = execServer(os.Args[2])
	case len(os.Args) >= 5 && os.Args[1] == "rsh":
		err = rsh(os.Args[2], os.Args[3], os.Args[4:])
		if err != nil {
			fmt.Fprintln(os.Stderr, "rsh:", err)
			os.Exit(1)
		}
	default:
		err = errors.New("usage: guest serve ADDR | guest dial ADDR N PHASES DIR | guest exec-server PORT | guest rsh PORT HOST CMD")
	}
	if err != nil {
		fmt.Println("GUEST FAIL", err)
		os.Exit(1)
	}
}

func serve(addr string) error {
	ln, err := guestlib.Listen("tcp4", addr)
	if err != nil {
		return err
	}
	defer ln.Close()
	fmt.Println("GUEST LISTENING", addr)
	c, err := ln.Accept()
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * deadline))
	n, err := io.Copy(c, c)
	if err != nil {
		return fmt.Errorf("echo after %d bytes: %w", n, err)
	}
	fmt.Printf("GUEST OK serve echoed=%d\n", n)
	return nil
}

func dial(addr string, n, phases int, dir string) error {
	var c *guestlib.Conn
	var err error
	for end := time.Now().Add(deadline); ; time.Sleep(200 * time.Millisecond) {
		if c, err = guestlib.Dial("tcp4", addr); err == nil || time.Now().After(end) {
			break
		}
	}
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * deadline))
	got := make(chan error, 1)
	echoed := make(chan int, phases) // the echo's end of each part
	go func() { got <- check(c, n, n/phases, echoed) }()
	t0 := time.Now()
	tx := rand.New(rand.NewPCG(1, 7))
	buf := make([]byte, 32<<10)
	sent := 0
	for k := 1; k <= phases; k++ {
		part := n / phases
		if k == phases {
			part = n - sent
		}
		for end := sent + part; sent < end; {
			m := min(len(buf), end-sent)
			for i := range m {
				buf[i] = byte(tx.Uint32())
			}
			if _, err := c.Write(buf[:m]); err != nil {
				return fmt.Errorf("write at %d: %w (path %s)", sent, err, c.Path())
			}
			sent += m
		}
		if k == phases {
			break
		}
		select {
		case at := <-echoed:
			fmt.Printf("GUEST AT %d echoed=%d path=%s seconds=%.2f\n", k, at, c.Path(), time.Since(t0).Seconds())
		case err := <-got:
			return fmt.Errorf("the echo ended before part %d came back: %v", k, err)
		case <-time.After(deadline):
			return fmt.Errorf("the echo of part %d not back within %s (path %s)", k, deadline, c.Path())
		}
		if err := os.WriteFile(filepath.Join(dir, "at"+strconv.Itoa(k)), nil, 0o644); err != nil {
			return err
		}
		if err := waitFile(filepath.Join(dir, "go"+strconv.Itoa(k))); err != nil {
			return err
		}
	}
	// Where the connection is when the last byte went: the relay (shunt)
	// unless something moved it since the last part's start.
	fmt.Printf("GUEST SENT %d path=%s seconds=%.2f\n", sent, c.Path(), time.Since(t0).Seconds())
	c.CloseWrite()
	if err := <-got; err != nil {
		return err
	}
	st := c.Stats()
	fmt.Printf("GUEST OK dial sent=%d echoed=%d path=%s seconds=%.2f stats=%+v\n", sent, n, c.Path(), time.Since(t0).Seconds(), st)
	return nil
}

// check reads the echo and compares it with the seed; at every part's
// end it says so on echoed.
func check(c io.Reader, n, part int, echoed chan<- int) error {
	rx := rand.New(rand.NewPCG(1, 7))
	buf, want := make([]byte, 32<<10), make([]byte, 32<<10)
	at := 0
	for at < n {
		k, err := c.Read(buf[:min(len(buf), n-at)])
		for i := range k {
			want[i] = byte(rx.Uint32())
		}
		if !bytes.Equal(buf[:k], want[:k]) {
			return fmt.Errorf("the echo differs from the seed at %d..%d", at, at+k)
		}
		for p := (at/part + 1) * part; p <= at+k && p < n; p += part {
			echoed <- p
		}
		at += k
		if err != nil && at < n {
			return fmt.Errorf("echo read at %d: %w", at, err)
		}
	}
	// Nothing more: the echo ends with the stream.
	if k, err := c.Read(buf); k != 0 || err != io.EOF {
		return fmt.Errorf("after the %d bytes: %d more, %v", n, k, err)
	}
	return nil
}

func waitFile(path string) error {
	for end := time.Now().Add(deadline); ; time.Sleep(20 * time.Millisecond) {
		if _, err := os.Stat(path); err == nil {
			return nil
		}
		if time.Now().After(end) {
			return fmt.Errorf("no %s within %s", path, deadline)
		}
	}
}

// execServer runs the shell command each connection sends (one line),
// with its output back on the connection, until killed.
func execServer(port string) error {
	l, err := net.Listen("tcp4", ":"+port)
	if err != nil {
		return err
	}
	fmt.Println("GUEST EXEC-SERVER", port)
	return execserve.Serve(l, nil, "", func(format string, args ...any) { fmt.Printf("GUEST "+format+"\n", args...) })
}

// rsh runs cmd at host's exec server and copies its output to stdout.
func rsh(port, host string, cmd []string) error {
	c, err := net.DialTimeout("tcp4", net.JoinHostPort(host, port), 10*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	if _, err := fmt.Fprintln(c, strings.Join(cmd, " ")); err != nil {
		return err
	}
	_, err = io.Copy(os.Stdout, c)
	return err
}
