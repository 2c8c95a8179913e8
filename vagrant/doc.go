// Package vagrant is the operators' Vagrant (libvirt) rig: Vagrantfile,
// provision.sh, hostd.hcl and a README. Its tests check the parts that can
// be checked without Vagrant.
package vagrant
