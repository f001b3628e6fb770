# ctest packaging.install_and_consume: `cmake --install` this build into a fresh prefix, check what
# it holds, run the installed `samebits`, then configure, build and run examples/consumer against the
# prefix (find_package(samebits CONFIG REQUIRED) + samebits::samebits). Last, without the installed
# samebitsConfig.cmake the consumer must fail to configure: it found samebits in this prefix only.
#   cmake -DBUILD=build -DSOURCE=. -DWORK=DIR -DGENERATOR=Ninja -DCXX=g++ -DLIBDIR=lib -P consumer.cmake
include(${CMAKE_CURRENT_LIST_DIR}/script_util.cmake)
require_vars(consumer.cmake BUILD SOURCE WORK GENERATOR CXX LIBDIR)

set(prefix ${WORK}/prefix)
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
# The consumer sees neither the build tree's libraries nor a samebits installed elsewhere.
unset(ENV{LD_LIBRARY_PATH})
unset(ENV{CMAKE_PREFIX_PATH})
unset(ENV{samebits_DIR})

run("cmake --install" ${CMAKE_COMMAND} --install ${BUILD} --prefix ${prefix})
set(cmake_dirs ${prefix}/${LIBDIR}/cmake/samebits)
foreach(f include/samebits/chain.hpp include/samebits/ops.hpp bin/samebits)
  if(NOT EXISTS ${prefix}/${f})
    message(FATAL_ERROR "the install lacks ${f}")
  endif()
endforeach()
foreach(f samebitsConfig.cmake samebitsConfigVersion.cmake samebitsTargets.cmake)
  if(NOT EXISTS ${cmake_dirs}/${f})
    message(FATAL_ERROR "the install lacks ${cmake_dirs}/${f}")
  endif()
endforeach()
file(GLOB_RECURSE python_bits ${prefix}/_core*)
if(python_bits)
  message(FATAL_ERROR "the Python extension is pip's to install, not cmake's: ${python_bits}")
endif()

# The installed command finds the installed library (its RPATH), not the build tree's.
run("${prefix}/bin/samebits version" ${prefix}/bin/samebits version)
if(NOT out MATCHES "^samebits [0-9]+\\.[0-9]+\\.[0-9]+")
  message(FATAL_ERROR "${prefix}/bin/samebits version printed: ${out}")
endif()
message(STATUS "installed: ${out}")

set(configure ${CMAKE_COMMAND} -S ${SOURCE}/examples/consumer -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX}
    -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF)
run("configuring examples/consumer" ${configure} -B ${WORK}/consumer)
file(STRINGS ${WORK}/consumer/CMakeCache.txt found REGEX "^samebits_DIR:")
if(NOT found STREQUAL "samebits_DIR:PATH=${cmake_dirs}")
  message(FATAL_ERROR "examples/consumer found samebits elsewhere: ${found} (want ${cmake_dirs})")
endif()
run("building examples/consumer" ${CMAKE_COMMAND} --build ${WORK}/consumer)
run("running examples/consumer" ${WORK}/consumer/consumer)
if(NOT out MATCHES "same bits alone and packed")
  message(FATAL_ERROR "examples/consumer printed:\n${out}")
endif()
message(STATUS "${out}")

# The check above can fail: with the package file gone, find_package must not succeed.
file(RENAME ${cmake_dirs}/samebitsConfig.cmake ${cmake_dirs}/samebitsConfig.cmake.away)
execute_process(COMMAND ${configure} -B ${WORK}/consumer-without-config RESULT_VARIABLE rc
                OUTPUT_QUIET ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "samebitsConfig.cmake")
  message(FATAL_ERROR "examples/consumer configured without the installed samebitsConfig.cmake (${rc}):\n${err}")
endif()
file(REMOVE_RECURSE ${WORK})
