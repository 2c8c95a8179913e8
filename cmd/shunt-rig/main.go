//go:build linux

// Command shunt-rig creates and removes the network-namespace test host that
// Shunt's tests, demo and benchmarks use (see integration/nsrig).
//
//	shunt-rig create [-name demo] [-guests 2]
//	shunt-rig destroy [-name demo] [-guests 2]
//	shunt-rig exec [-name demo] GUEST -- command args...   (GUEST: g1, g2, ..., host)
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"

	"github.com/shuntnet/shunt/integration/nsrig"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: shunt-rig create|destroy|exec [-name NAME] [-guests N] [GUEST -- cmd...]")
		os.Exit(2)
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	name := fs.String("name", "demo", "rig name (1-8 characters)")
	n := fs.Int("guests", 2, "number of guests")
	fs.Parse(os.Args[2:])
	r, err := nsrig.New(*name, *n)
	if err != nil {
		fail(err)
	}
	switch os.Args[1] {
	case "create":
		if err := r.Create(); err != nil {
			fail(err)
		}
		fmt.Printf("rig %s: host netns %s\n", r.Name, r.HostNS)
		for _, g := range r.Guests {
			fmt.Printf("  %s: netns %s, address %s, host interface %s\n", g.Name, g.NS, g.Addr, g.HostIf)
		}
	case "destroy":
		if err := r.Destroy(); err != nil {
			fail(err)
		}
	case "exec":
		args := fs.Args()
		if len(args) < 3 || args[1] != "--" {
			fail(fmt.Errorf("usage: shunt-rig exec GUEST -- COMMAND [ARGS]"))
		}
		ns := r.HostNSPath()
		for _, g := range r.Guests {
			if g.Name == args[0] {
				ns = g.NSPath()
			}
		}
		cmd := exec.Command(args[2], args[3:]...)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
		if err := nsrig.Start(ns, cmd); err != nil {
			fail(err)
		}
		if err := cmd.Wait(); err != nil {
			fail(err)
		}
	default:
		fail(fmt.Errorf("unknown command %q", os.Args[1]))
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "shunt-rig:", err)
	os.Exit(1)
}
